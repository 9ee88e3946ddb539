"""The vLLM backend, :class:`AsyncVirtualLM`.

:mod:`.backend` is the class (with :mod:`.logprobs`, :mod:`.lora` and :mod:`.sampling`, its
mixins); :mod:`.engine` steps the engine on the engine thread; :mod:`.capture` and
:mod:`.forcing` run inside the engine step; :mod:`.sessions` keeps requests alive as engine
sessions; :mod:`.startup` builds the engine; :mod:`genlm_backend.llm.row_ring` carries rows from worker
processes. :mod:`.internals` is the seam: the one package that touches vLLM's private parts.
Importing this package works without vllm installed (the class can be named, not used).
"""

from __future__ import annotations

from typing import Any

from .backend import DEFAULT_ENGINE_OPTS, AsyncVirtualLM

__all__ = ["AsyncVirtualLM", "DEFAULT_ENGINE_OPTS", "listing_refusal"]


def __getattr__(name: str) -> Any:
    if name == "listing_refusal":  # needs vllm
        from .logprobs import listing_refusal

        return listing_refusal
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
