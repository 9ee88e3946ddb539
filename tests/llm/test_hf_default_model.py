"""The default model on the transformers backend, built as users build it: a prompt's row does
not depend on the other prompts of its batch.

``AsyncTransformer.from_name(default_model_dir())`` with no ``hf_opts`` loads the model in
float32 on a machine without CUDA. The reference is an independent plain forward pass of each
prompt alone (``next_token_logprobs_uncached``: no batch, no padding, no cached states).
Tolerance: 1e-4 (max abs difference of log-probabilities). Batching, padding and resuming
from cached states only reorder float32 operations, which moves rows of this model by at most
5e-5 (measured on 2 CPU cores with 1 and 2 threads); the same batches in bfloat16, the
checkpoint's dtype, move rows by up to 0.35 nats (0.12 among the ten likeliest tokens).
"""

from __future__ import annotations

import pytest
import torch

from genlm_backend.llm.default_model import default_model_dir
from genlm_backend.llm.hf import AsyncTransformer

TOL = 1e-4
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "A",
    "The quick brown fox jumps over the lazy dog because it was",
    "1, 2, 3, 4,",
    "Hello, wörld! How are you?",
    "In 1492, Columbus sailed the ocean blue and then he",
]


@pytest.fixture(scope="module")
def default_lm():
    if torch.cuda.is_available():  # there the default is the checkpoint's bfloat16 (documented)
        pytest.skip("this machine has CUDA: the default dtype there is the checkpoint's")
    lm = AsyncTransformer.from_name(str(default_model_dir()))
    yield lm
    lm.cleanup()


def max_difference(rows, prompts, lm) -> float:
    return max(
        float((row - lm.next_token_logprobs_uncached(p)).abs().max())
        for row, p in zip(rows, prompts)
    )


@pytest.mark.slow
def test_default_model_loads_in_float32_without_cuda(default_lm):
    assert default_lm.model.dtype == torch.float32


@pytest.mark.slow
def test_row_in_a_batch_of_other_lengths_equals_the_row_alone(default_lm):
    prompts = [default_lm.tokenizer.encode(text) for text in TEXTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # every length differs: padding
    default_lm.clear_cache()
    rows = default_lm.batch_next_token_logprobs_sync(prompts)
    assert max_difference(rows, prompts, default_lm) <= TOL
    for pair in ([prompts[0], prompts[3]], [prompts[3], prompts[1]]):
        default_lm.clear_cache()
        rows = default_lm.batch_next_token_logprobs_sync(pair)
        assert max_difference(rows, pair, default_lm) <= TOL


@pytest.mark.slow
def test_rows_resumed_from_cached_states_of_other_lengths_equal_the_row_alone(default_lm):
    prompts = [default_lm.tokenizer.encode(text) for text in TEXTS]
    default_lm.clear_cache()
    default_lm.batch_next_token_logprobs_sync(prompts)
    extended = [p + [28] for p in prompts]  # one new token each on cached states of 8 widths
    rows = default_lm.batch_next_token_logprobs_sync(extended)
    assert default_lm.stats()["num_reused_tokens"] >= sum(len(p) for p in prompts)
    assert max_difference(rows, extended, default_lm) <= TOL
