"""The Hugging Face transformers backend, :class:`AsyncTransformer`.

:mod:`.transformer` is the class, a front over its engine (:mod:`.transformer_engine`, with
:mod:`.peft_adapters`, its peft adapters); :mod:`.forward` plans and runs the batched forward
passes; :mod:`.kvtrie` keeps past keys and values in a trie of token blocks; :mod:`.kv_cache`
converts them to and from transformers' cache objects.
"""

from __future__ import annotations

from .transformer import AsyncTransformer

__all__ = ["AsyncTransformer"]
