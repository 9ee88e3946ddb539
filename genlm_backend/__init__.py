"""genlm_backend: exact, auto-batched next-token log-probabilities for probabilistic programs.

Await ``lm.next_token_logprobs(token_ids)`` from as many coroutines as you like; concurrent
awaits become one engine batch. Names are imported on first use, so ``import genlm_backend``
is cheap and never imports vllm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .compat import install_genlm_alias

if TYPE_CHECKING:
    from .llm import AsyncLM, AsyncTransformer, AsyncVirtualLM, MockAsyncLM, load_model_by_name  # noqa: F401
    from .tokenization import Token, decode_vocab, replace_prefix_tokens  # noqa: F401
    from .trie import AsyncTokenCharacterTrie, ParallelTokenCharacterTrie, TokenCharacterTrie  # noqa: F401

__version__ = "0.1.0"

_EXPORTS = {
    "load_model_by_name": ".llm",
    "AsyncLM": ".llm",
    "AsyncVirtualLM": ".llm",
    "AsyncTransformer": ".llm",
    "MockAsyncLM": ".llm",
    "decode_vocab": ".tokenization",
    "Token": ".tokenization",
    "replace_prefix_tokens": ".tokenization",
    "TokenCharacterTrie": ".trie",
    "ParallelTokenCharacterTrie": ".trie",
    "AsyncTokenCharacterTrie": ".trie",
}

__all__ = [*_EXPORTS, "install_genlm_alias"]  # noqa: PLE0604 - _EXPORTS's keys are strings


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
