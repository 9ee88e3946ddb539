"""`MockAsyncLM`: deterministic pseudo-random log-probabilities, for testing programs."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .base import AsyncLM, LogprobsRequest
from .engine import EngineAttribute, ThreadedEngine

__all__ = ["MockAsyncLM", "MockEngine"]


class MockAsyncLM(AsyncLM):
    """A stand-in model: each prompt gets its own fixed random next-token distribution.

    The row for a prompt is ``log_softmax`` of standard normal logits drawn from a generator
    seeded by a hash of the prompt's token ids (and the adapter name, if any), so the same
    prompt always gets the same row, in every process. It goes through the same batcher,
    cache and validation as the real backends, so programs can be tested against it.

    Args:
        tokenizer: a Hugging Face tokenizer (only its vocabulary is used).
        vocab_size: the output size V; defaults to ``len(tokenizer)``.
        **kwargs: ``batch_size``, ``timeout``, ``cache_size``, ``cache_opts``, ``flush`` of
            :class:`~genlm_backend.llm.base.AsyncLM`.
    """

    engine: MockEngine

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, **kwargs: Any):
        size = int(vocab_size) if vocab_size is not None else len(tokenizer)
        super().__init__(tokenizer, MockEngine(size), **kwargs)

    @classmethod
    def from_name(cls, model_name: str, **kwargs: Any) -> MockAsyncLM:
        """Loads only the tokenizer of ``model_name`` (a local folder or a hub id)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(model_name), **kwargs)

    num_evaluated = EngineAttribute()  # how many distinct requests the engine evaluated

    def logprobs_of(self, token_ids: Sequence[int], lora_name: str | None = None) -> torch.Tensor:
        """The row this mock returns for ``token_ids``, computed directly (no batching)."""
        self._check_open()
        return self.engine.row(token_ids, lora_name)


class MockEngine(ThreadedEngine):
    """The engine of :class:`MockAsyncLM`: rows seeded by the prompt, on a thread of its own."""

    def __init__(self, vocab_size: int):
        super().__init__("genlm-MockAsyncLM")
        self.vocab_size = vocab_size
        self.num_evaluated = 0

    def evaluate_batch(self, requests: list[LogprobsRequest]) -> Sequence[torch.Tensor]:
        self.num_evaluated += len(requests)
        return [self.row(r.token_ids, r.lora_name) for r in requests]

    def load_adapter(self, name: str, path: str, adapter_id: int) -> None:
        """Adapters only change the seed of the rows: enough to test adapter routing."""

    def unload_adapter(self, name: str) -> None:
        pass

    def row(self, token_ids: Sequence[int], lora_name: str | None) -> torch.Tensor:
        digest = hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8)
        if lora_name is not None:
            digest.update(lora_name.encode("utf-8"))
        generator = torch.Generator().manual_seed(int.from_bytes(digest.digest(), "big") >> 1)
        logits = torch.randn(self.vocab_size, generator=generator)
        return torch.log_softmax(logits, dim=-1)
