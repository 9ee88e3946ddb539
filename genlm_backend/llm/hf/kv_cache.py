"""The one seam between the Hugging Face backend and transformers' cache internals.

Everything that knows how transformers stores past key/values lives here:
:func:`make_past` builds a ``DynamicCache`` around tensors we already hold (without copying
them), :func:`cache_argument` names the forward pass's argument that takes it (``cache`` from
transformers 5.24, ``past_key_values`` before), :func:`returned_cache` and :func:`read_past`
take the tensors back out after a forward pass, and :func:`accepts_logits_to_keep` asks
whether a model can skip computing logits that nobody reads.

Checked against transformers 4.56, 4.57, 5.19 and 5.24 (``DynamicCache.layers`` of
``DynamicLayer`` with ``keys``/``values`` tensors ``[batch, kv_heads, seq, head_dim]``).
``tests/llm/test_hf_cache.py`` checks that a cache built here equals one built by
transformers' own public constructor, so a change of layout fails loudly instead of silently
corrupting results, and that the backend calls nothing the installed version deprecates.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

__all__ = [
    "accepts_logits_to_keep",
    "cache_argument",
    "make_past",
    "read_past",
    "returned_cache",
]

KV = tuple[torch.Tensor, torch.Tensor]


def make_past(layers: list[KV] | None) -> Any:
    """A ``DynamicCache`` holding ``layers`` (one ``(keys, values)`` pair per decoder layer).

    The tensors are used as they are (no copy); the model's forward pass then appends the new
    positions by concatenation, which allocates new tensors and leaves these untouched.
    ``None`` gives an empty cache that the forward pass fills.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    if not layers:
        return cache
    if isinstance(getattr(cache, "layers", None), list):
        from transformers.cache_utils import DynamicLayer

        for keys, values in layers:
            layer = DynamicLayer()
            _initialise(layer, keys, values)  # whatever bookkeeping this version keeps
            layer.keys, layer.values = keys, values
            cache.layers.append(layer)
        return cache
    if hasattr(DynamicCache, "from_legacy_cache"):  # transformers 4.x
        return DynamicCache.from_legacy_cache(tuple(layers))
    raise RuntimeError(  # pragma: no cover - a transformers layout this module does not know
        "genlm_backend cannot build a transformers DynamicCache in this version of transformers; "
        "update genlm_backend/llm/hf/kv_cache.py"
    )


def _initialise(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
    try:
        layer.lazy_initialization(keys, values)  # transformers >= 5.x
    except TypeError:
        layer.lazy_initialization(keys)  # transformers 4.56-4.57
    layer.is_initialized = True


def read_past(cache: Any) -> list[KV]:
    """The ``(keys, values)`` tensors of every layer of a cache returned by a forward pass."""
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        return [(layer.keys, layer.values) for layer in layers]
    if hasattr(cache, "key_cache"):  # transformers 4.x
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):  # legacy tuples
        return [(k, v) for k, v, *_ in cache]
    raise RuntimeError(  # pragma: no cover
        f"genlm_backend cannot read a {type(cache).__name__}; "
        "update genlm_backend/llm/hf/kv_cache.py"
    )


def cache_argument(model: Any) -> str:
    """The keyword that passes past key/values to ``model``'s forward pass.

    ``cache`` where the (base) model's forward takes it (transformers >= 5.24, which deprecates
    ``past_key_values``), else ``past_key_values``. A peft model forwards keyword arguments to
    its base model, so the base model's signature decides.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return _cache_argument(type(base))


@functools.cache
def _cache_argument(model_class: type) -> str:
    try:
        parameters = inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        parameters = {}
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    # A forward that names neither (a wrapper passing its keyword arguments on): the name of
    # the installed transformers' models.
    return "cache" if _renamed_cache() else "past_key_values"


@functools.cache
def _renamed_cache() -> bool:
    """Whether the installed transformers takes ``cache=`` (5.24 and later)."""
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("transformers")) >= Version("5.24")


def returned_cache(output: Any) -> Any:
    """The cache a forward pass returned: ``output.cache`` (transformers >= 5.24) or
    ``output.past_key_values``, read without touching the deprecated name."""
    return output["cache"] if "cache" in output else output["past_key_values"]


def accepts_logits_to_keep(model: Any) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (so logits of other positions are
    skipped)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return False
