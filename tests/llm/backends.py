"""The ``backend`` fixture: one test, run on the mock, the mock's engine in a process of its
own, the transformers and the vLLM backend.

Each comes with an independent reference of its rows: the mock's direct computation
(exactly, also for the engine in a child process), a plain fp32 forward pass of the same
weights for transformers (1e-5, the tolerance of ``test_hf.py``) and for vLLM (``ROW_ATOL``
of ``vllm_fixtures``: 1e-4 on CPU).
"""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import reference_logprobs, shared_tiny_llama, tiny_tokenizer
from vllm_fixtures import ROW_ATOL

from genlm_backend.llm import AsyncLM, MockAsyncLM, ProcessEngine
from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.mock import MockEngine

MOCK_VOCAB_SIZE = 300


class SizedTokenizer:
    def __len__(self) -> int:
        return MOCK_VOCAB_SIZE


class Backend:
    """A model under test and its independent reference ``reference(ids) -> [V]``."""

    def __init__(self, name: str, lm, reference, atol: float):
        self.name, self.lm, self.reference, self.atol = name, lm, reference, atol

    def check(self, row: torch.Tensor, ids) -> None:
        expected = self.reference(ids)
        assert row.shape == expected.shape
        assert (row.cpu() - expected).abs().max().item() <= self.atol


@pytest.fixture(params=["mock", "process", "hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request):
    if request.param == "mock":
        lm = MockAsyncLM(SizedTokenizer())
        yield Backend("mock", lm, lm.logprobs_of, 0.0)
        lm.cleanup()
    elif request.param == "process":
        lm = AsyncLM(SizedTokenizer(), ProcessEngine(MockEngine, MOCK_VOCAB_SIZE))
        reference = MockEngine(MOCK_VOCAB_SIZE)
        yield Backend("process", lm, lambda ids: reference.row(ids, None), 0.0)
        lm.cleanup()
        reference.close()
    elif request.param == "hf":
        lm = AsyncTransformer(shared_tiny_llama(), tiny_tokenizer())
        yield Backend("hf", lm, lambda ids: reference_logprobs(shared_tiny_llama(), ids), 1e-5)
        lm.cleanup()
    else:
        lm = request.getfixturevalue("vlm")
        reference = request.getfixturevalue("hf_reference")
        yield Backend("vllm", lm, lambda ids: reference("base", ids), ROW_ATOL)
