"""``next_token_logprobs`` returns its request's future inside a running loop (no task per
call under ``asyncio.gather``) and still behaves as an ``async def`` everywhere asyncio
takes a coroutine. Rows are compared exactly with the mock's direct computation."""

from __future__ import annotations

import asyncio
import inspect
import sys

import pytest
import torch

from genlm_backend.exceptions import ClosedError
from genlm_backend.llm import MockAsyncLM

V = 300


class SizedTokenizer:
    def __len__(self) -> int:
        return V


@pytest.fixture
def lm():
    model = MockAsyncLM(SizedTokenizer())
    yield model
    model.cleanup()


async def test_a_lockstep_gather_starts_no_task_per_call(lm):
    loop = asyncio.get_running_loop()
    started = []

    def factory(loop, coro, **kwargs):
        started.append(coro)
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(factory)
    try:
        rows = await asyncio.gather(*(lm.next_token_logprobs([i + 1, 2]) for i in range(16)))
    finally:
        loop.set_task_factory(None)
    assert started == []  # an ``async def`` call would have started 16 tasks here
    for i, row in enumerate(rows):
        assert torch.equal(row, lm.logprobs_of([i + 1, 2]))
    assert lm.stats()["num_batches"] == 1


async def test_asyncio_takes_the_call_wherever_it_takes_a_coroutine(lm):
    expected = lm.logprobs_of([7])
    call = lm.next_token_logprobs([7])
    assert asyncio.iscoroutine(call)
    assert torch.equal(await asyncio.create_task(lm.next_token_logprobs([7])), expected)
    assert torch.equal(await asyncio.wait_for(lm.next_token_logprobs([7]), timeout=5), expected)
    assert torch.equal(await asyncio.shield(lm.next_token_logprobs([7])), expected)
    if sys.version_info >= (3, 11):
        async with asyncio.TaskGroup() as group:
            task = group.create_task(lm.next_token_logprobs([7]))
        assert torch.equal(task.result(), expected)
    assert torch.equal(await call, expected)


def test_a_call_made_outside_a_loop_is_a_coroutine_that_asyncio_run_runs(lm):
    call = lm.next_token_logprobs([3, 4])
    assert inspect.iscoroutine(call)
    assert torch.equal(asyncio.run(call), lm.logprobs_of([3, 4]))
    loop = asyncio.new_event_loop()
    try:
        assert torch.equal(loop.run_until_complete(lm.next_token_logprobs([5])), lm.logprobs_of([5]))
    finally:
        loop.close()


async def test_errors_come_from_the_await_and_reach_only_their_caller(lm):
    bad = lm.next_token_logprobs([V])  # the call itself does not raise
    good = lm.next_token_logprobs([2])
    with pytest.raises(ValueError, match=f"token id {V} at position 0"):
        await bad
    assert torch.equal(await good, lm.logprobs_of([2]))
    task = asyncio.create_task(lm.next_token_logprobs([]))
    with pytest.raises(ValueError, match="empty prompt"):
        await task
    lm.cleanup()
    closed = lm.next_token_logprobs([2])
    with pytest.raises(ClosedError):
        await closed


async def test_cancelling_one_call_or_its_task_harms_no_other_awaiter():
    slow = MockAsyncLM(SizedTokenizer(), timeout=0.05, flush="timer")  # a batch after 50 ms
    try:
        first, second = slow.next_token_logprobs([6]), slow.next_token_logprobs([6])
        driven = asyncio.create_task(slow.next_token_logprobs([6, 6]))
        other = slow.next_token_logprobs([6, 6])
        await asyncio.sleep(0)
        first.cancel()
        driven.cancel()
        with pytest.raises(asyncio.CancelledError):
            await driven
        assert torch.equal(await second, slow.logprobs_of([6]))
        assert torch.equal(await other, slow.logprobs_of([6, 6]))
        with pytest.raises(asyncio.CancelledError):
            await first
    finally:
        slow.cleanup()


async def test_with_an_output_cache_the_call_is_a_coroutine_and_hits_the_cache():
    cached = MockAsyncLM(SizedTokenizer(), cache_size=8)
    try:
        call = cached.next_token_logprobs([9])
        assert inspect.iscoroutine(call)
        assert torch.equal(await call, cached.logprobs_of([9]))
        assert torch.equal(await cached.next_token_logprobs([9]), cached.logprobs_of([9]))
        assert cached.stats()["cache_hits"] == 1
    finally:
        cached.cleanup()


@pytest.mark.skipif(sys.version_info < (3, 12), reason="inspect.markcoroutinefunction is Python 3.12+")
def test_inspect_still_calls_the_method_a_coroutine_function(lm):
    assert inspect.iscoroutinefunction(lm.next_token_logprobs)
