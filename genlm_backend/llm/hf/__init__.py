"""The Hugging Face transformers backend, :class:`AsyncTransformer`.

:mod:`.backend` is the class (with :mod:`.lora`, its peft adapters); :mod:`.forward` plans and
runs the batched forward passes; :mod:`.kvtrie` keeps past keys and values in a trie of token
blocks; :mod:`.cache` converts them to and from transformers' cache objects.
"""

from __future__ import annotations

from .backend import AsyncTransformer

__all__ = ["AsyncTransformer"]
