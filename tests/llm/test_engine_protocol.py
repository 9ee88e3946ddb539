"""An engine of one's own behind ``AsyncLM`` (``genlm_backend.llm.engine``): the protocol as a
user plugs into it.

The engines here compute rows with a fixed linear model (``logits = W[last token]``); the
independent reference is the same formula computed directly, compared exactly (the same
float32 operations on the same numbers).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from genlm_backend.exceptions import ClosedError, EngineError, InvalidRequestError
from genlm_backend.llm import AsyncLM, Engine, SamplingEngine, ThreadedEngine

V = 50
WEIGHTS = torch.randn(V, V, generator=torch.Generator().manual_seed(0))


def reference(token_ids) -> torch.Tensor:
    return torch.log_softmax(WEIGHTS[token_ids[-1]], dim=-1)


class InlineEngine:
    """Rows computed on the event loop, returned at once; token 13 fails its request alone."""

    vocab_size = V
    max_prompt_len = 8

    def __init__(self):
        self.batches: list[list[tuple[int, ...]]] = []
        self.threads: set[str] = set()
        self.closed = 0

    def evaluate(self, requests):
        self.threads.add(threading.current_thread().name)
        self.batches.append([r.token_ids for r in requests])
        return [ValueError("unlucky") if r.token_ids[-1] == 13 else reference(r.token_ids)
                for r in requests]

    def close(self):
        self.closed += 1


class OwnThreadEngine(ThreadedEngine):
    """Rows computed on the engine's own thread."""

    vocab_size = V

    def __init__(self):
        super().__init__("my-engine")
        self.threads: set[str] = set()

    def evaluate_batch(self, requests):
        self.threads.add(threading.current_thread().name)
        return [reference(r.token_ids) for r in requests]


class NativeSampler(InlineEngine):
    """An inline engine with a sampler of its own: the prompt's last token, repeated."""

    def __init__(self):
        super().__init__()
        self.sampled: list[tuple] = []

    async def sample(self, request, max_tokens, eos_token_ids, temperature, seed, options):
        self.sampled.append((request.token_ids, max_tokens, temperature, seed, options))
        return [request.token_ids[-1]] * max_tokens


def test_the_engines_follow_the_protocol():
    assert isinstance(InlineEngine(), Engine) and not isinstance(InlineEngine(), SamplingEngine)
    assert isinstance(NativeSampler(), SamplingEngine)
    engine = OwnThreadEngine()
    assert isinstance(engine, Engine)
    engine.close()


async def test_an_inline_engine_gets_one_batch_of_distinct_requests_on_the_loop():
    engine = InlineEngine()
    lm = AsyncLM(None, engine, timeout=0.01)
    prompts = [[1, 2], [3, 4], [1, 2], [5]]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))
    for prompt, row in zip(prompts, rows):
        assert torch.equal(row, reference(prompt))
    assert engine.batches == [[(1, 2), (3, 4), (5,)]]
    assert engine.threads == {threading.current_thread().name}
    lm.cleanup()
    lm.cleanup()
    assert engine.closed == 1


async def test_a_row_given_as_an_exception_fails_only_its_caller():
    lm = AsyncLM(None, InlineEngine(), timeout=0.01)
    bad, good = await asyncio.gather(lm.next_token_logprobs([2, 13]),
                                     lm.next_token_logprobs([2, 14]), return_exceptions=True)
    assert isinstance(bad, ValueError)
    assert torch.equal(good, reference([2, 14]))
    lm.cleanup()


async def test_the_engine_sizes_are_checked_before_anything_is_queued():
    engine = InlineEngine()
    lm = AsyncLM(None, engine, timeout=0.01)
    with pytest.raises(InvalidRequestError):
        await lm.next_token_logprobs([V])  # outside [0, V)
    with pytest.raises(InvalidRequestError):
        await lm.next_token_logprobs(list(range(9)))  # longer than max_prompt_len
    assert engine.batches == [] and lm.vocab_size == V and lm.max_prompt_len == 8
    lm.cleanup()


async def test_a_threaded_engine_runs_its_batches_on_its_thread():
    engine = OwnThreadEngine()
    lm = AsyncLM(None, engine, timeout=0.01)
    rows = await lm.batch_next_token_logprobs([[1], [2, 3]])
    assert torch.equal(rows, torch.stack([reference([1]), reference([2, 3])]))
    assert lm.next_token_logprobs_sync([4]).equal(reference([4]))
    assert engine.threads == {"my-engine"}
    lm.cleanup()
    with pytest.raises(ClosedError):
        await lm.next_token_logprobs([1])


async def test_an_engine_that_raises_fails_the_batch_with_an_engine_error():
    class Broken(InlineEngine):
        def evaluate(self, requests):
            raise RuntimeError("boom")

    lm = AsyncLM(None, Broken(), timeout=0.01)
    with pytest.raises(EngineError):
        await lm.next_token_logprobs([1])
    lm.cleanup()


async def test_adapters_are_refused_without_the_capability():
    lm = AsyncLM(None, InlineEngine(), timeout=0.01)
    with pytest.raises(NotImplementedError):
        lm.add_new_lora("/some/folder", "a")
    lm.cleanup()


async def test_sampling_uses_the_engine_sampler_where_it_has_one():
    engine = NativeSampler()
    lm = AsyncLM(None, engine, timeout=0.01)
    assert await lm.sample([1, 7], 3, [0], temperature=0.5, seed=4) == [7, 7, 7]
    assert await lm.batch_sample([[2], [3]], 2, [], seed=10) == [[2, 2], [3, 3]]
    assert engine.sampled[0] == ((1, 7), 3, 0.5, 4, {})
    assert sorted(s[3] for s in engine.sampled[1:]) == [10, 11]
    assert engine.batches == []  # no row was asked for
    lm.cleanup()


async def test_without_a_sampler_sampling_draws_from_the_rows():
    engine = InlineEngine()
    lm = AsyncLM(None, engine, timeout=0.01)
    tokens = await lm.sample([1], 3, [], temperature=0)
    expected, context = [], [1]
    for _ in range(3):
        expected.append(int(reference(context).argmax()))
        context.append(expected[-1])
    assert tokens == expected
    lm.cleanup()
