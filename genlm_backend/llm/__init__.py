"""Language-model backends behind one contract, :class:`AsyncLM`.

Here: the contract (:mod:`.base`, with :mod:`.prompts`, :mod:`.validation` and
:mod:`.adapters`), composed around an engine (:mod:`.engine`: the protocol a backend's
engine follows, also for backends of your own), :class:`MockAsyncLM`,
:func:`load_model_by_name` (:mod:`.loading`), the embedded default model, and
:class:`ProcessEngine` (:mod:`.engine_process`: an engine in a process of its own). The backends
are packages: :mod:`.vllm` (``AsyncVirtualLM``, with :mod:`.vllm.internals`, the seam to
vLLM's private parts) and :mod:`.hf` (``AsyncTransformer``). They are imported on first
use, so importing this package never imports vllm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import AsyncLM
from .engine import AdapterEngine, Engine, SamplingEngine, ThreadedEngine
from .engine_process import ProcessEngine
from .loading import load_model_by_name
from .mock import MockAsyncLM

if TYPE_CHECKING:
    from .hf import AsyncTransformer
    from .vllm import AsyncVirtualLM

__all__ = [
    "AdapterEngine",
    "AsyncLM",
    "AsyncTransformer",
    "AsyncVirtualLM",
    "Engine",
    "MockAsyncLM",
    "ProcessEngine",
    "SamplingEngine",
    "ThreadedEngine",
    "load_model_by_name",
]

_LAZY = {"AsyncVirtualLM": ".vllm", "AsyncTransformer": ".hf"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
