"""Every asyncio pattern a program may use on the async methods, on every backend.

The contract: each ``async`` method is a coroutine function (``inspect.iscoroutinefunction``),
and its call works with ``await``, ``gather``, ``create_task``, ``ensure_future`` +
``asyncio.wait``, ``wait_for``, ``TaskGroup``, ``unittest.mock`` autospecs, and when it is
handed to another event loop (``run_coroutine_threadsafe``, ``asyncio.run`` in a thread).

Rows are compared with an independent reference of each backend (see ``backends.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import threading
from unittest import mock

import pytest
import torch
from backends import MOCK_VOCAB_SIZE as V
from backends import SizedTokenizer, backend  # noqa: F401 - the fixture

from genlm_backend.exceptions import ClosedError
from genlm_backend.llm import AsyncLM, MockAsyncLM
from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.vllm import AsyncVirtualLM
from genlm_backend.trie import AsyncTokenCharacterTrie

# The async methods of the contract, per class.
LM_ASYNC = ("next_token_logprobs", "batch_next_token_logprobs", "sample", "batch_sample",
            "__aenter__", "__aexit__")
TRIE_ASYNC = ("weight_sum", "weight_max", "cleanup", "__aenter__", "__aexit__")
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


@pytest.mark.parametrize("cls", [AsyncLM, MockAsyncLM, AsyncTransformer, AsyncVirtualLM])
def test_every_async_method_of_a_model_is_a_coroutine_function(cls):
    for name in LM_ASYNC:
        assert inspect.iscoroutinefunction(getattr(cls, name)), name
        assert asyncio.iscoroutinefunction(getattr(cls, name)), name


def test_every_async_method_of_the_async_trie_is_a_coroutine_function():
    for name in TRIE_ASYNC:
        assert inspect.iscoroutinefunction(getattr(AsyncTokenCharacterTrie, name)), name


@pytest.mark.parametrize("cls", [MockAsyncLM, AsyncTransformer, AsyncVirtualLM])
async def test_an_autospec_of_a_model_is_awaitable(cls):
    spec = mock.create_autospec(cls, instance=True)
    spec.next_token_logprobs.return_value = torch.zeros(3)
    for name in LM_ASYNC:
        assert isinstance(getattr(spec, name), mock.AsyncMock), name
    call = spec.next_token_logprobs([1, 2])
    assert inspect.isawaitable(call)
    assert torch.equal(await call, torch.zeros(3))
    await asyncio.wait_for(spec.batch_next_token_logprobs([[1]]), timeout=5)
    spec.next_token_logprobs.assert_awaited_once_with([1, 2])


async def test_an_autospec_of_the_async_trie_is_awaitable():
    spec = mock.create_autospec(AsyncTokenCharacterTrie, instance=True)
    for name in TRIE_ASYNC:
        call = getattr(spec, name)(*([None] if name.startswith("weight") else []))
        assert inspect.isawaitable(call), name
        await call


async def test_await_gather_create_task_wait_for(backend):
    lm = backend.lm
    backend.check(await lm.next_token_logprobs(PROMPTS[0]), PROMPTS[0])
    rows = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS))
    for row, prompt in zip(rows, PROMPTS):
        backend.check(row, prompt)
    backend.check(await asyncio.create_task(lm.next_token_logprobs(PROMPTS[1])), PROMPTS[1])
    row = await asyncio.wait_for(lm.next_token_logprobs(PROMPTS[2]), timeout=60)
    backend.check(row, PROMPTS[2])
    backend.check(await asyncio.shield(lm.next_token_logprobs(PROMPTS[0])), PROMPTS[0])


async def test_ensure_future_and_asyncio_wait(backend):
    lm = backend.lm
    futures = [asyncio.ensure_future(lm.next_token_logprobs(p)) for p in PROMPTS]
    batch = asyncio.ensure_future(lm.batch_next_token_logprobs(PROMPTS))
    done, pending = await asyncio.wait([*futures, batch], timeout=60)
    assert not pending and len(done) == len(PROMPTS) + 1
    for future, prompt in zip(futures, PROMPTS):
        backend.check(future.result(), prompt)
    for row, prompt in zip(batch.result(), PROMPTS):
        backend.check(row, prompt)
    alone = asyncio.ensure_future(lm.next_token_logprobs(PROMPTS[0]))
    first, _ = await asyncio.wait([alone], return_when=asyncio.FIRST_COMPLETED)
    backend.check(first.pop().result(), PROMPTS[0])


@pytest.mark.skipif(sys.version_info < (3, 11), reason="asyncio.TaskGroup is Python 3.11+")
async def test_task_group(backend):
    lm = backend.lm
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(lm.next_token_logprobs(p)) for p in PROMPTS]
        batch = group.create_task(lm.batch_next_token_logprobs(PROMPTS))
    for task, row, prompt in zip(tasks, batch.result(), PROMPTS):
        backend.check(task.result(), prompt)
        backend.check(row, prompt)


class OtherLoop:
    """An event loop running in a thread of its own."""

    def __enter__(self) -> asyncio.AbstractEventLoop:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self.loop

    def __exit__(self, *exc_info) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=60)
        self.loop.close()


async def test_a_call_made_here_and_run_on_another_loop(backend):
    lm = backend.lm
    before = lm.stats()["num_requests"]
    with OtherLoop() as other:
        job = asyncio.run_coroutine_threadsafe(lm.next_token_logprobs(PROMPTS[1]), other)
        row = await asyncio.wrap_future(job)
        backend.check(row, PROMPTS[1])
        # Alongside requests of this loop, at the same time.
        jobs = [asyncio.run_coroutine_threadsafe(lm.next_token_logprobs(p), other) for p in PROMPTS]
        here = await asyncio.gather(*(lm.next_token_logprobs(p) for p in PROMPTS))
        there = [await asyncio.wrap_future(j) for j in jobs]
    for a, b, prompt in zip(here, there, PROMPTS):
        backend.check(a, prompt)
        backend.check(b, prompt)
    assert lm.stats()["num_requests"] - before == 1 + 2 * len(PROMPTS)  # each request ran once


async def test_a_call_made_here_and_run_by_asyncio_run_in_a_thread(backend):
    lm = backend.lm
    row = await asyncio.to_thread(asyncio.run, lm.next_token_logprobs(PROMPTS[2]))
    backend.check(row, PROMPTS[2])
    rows = await asyncio.to_thread(asyncio.run, lm.batch_next_token_logprobs(PROMPTS))
    for row, prompt in zip(rows, PROMPTS):
        backend.check(row, prompt)


def test_a_call_made_outside_a_loop_runs_in_asyncio_run(backend):
    lm = backend.lm
    call = lm.next_token_logprobs(PROMPTS[0])
    assert inspect.iscoroutine(call)
    backend.check(asyncio.run(call), PROMPTS[0])
    loop = asyncio.new_event_loop()
    try:
        backend.check(loop.run_until_complete(lm.next_token_logprobs(PROMPTS[1])), PROMPTS[1])
    finally:
        loop.close()


async def test_sampling_calls_take_every_pattern(backend):
    lm = backend.lm
    args = {"max_tokens": 3, "eos_token_ids": [], "temperature": 1.0}
    alone = await lm.sample(PROMPTS[0], seed=11, **args)
    assert len(alone) == 3
    task = asyncio.ensure_future(lm.sample(PROMPTS[0], seed=11, **args))
    batch = asyncio.ensure_future(lm.batch_sample([PROMPTS[0]], seed=11, **args))
    _, pending = await asyncio.wait([task, batch], timeout=60)
    assert not pending
    assert task.result() == alone and batch.result() == [alone]
    with OtherLoop() as other:
        job = asyncio.run_coroutine_threadsafe(lm.sample(PROMPTS[0], seed=11, **args), other)
        assert await asyncio.wrap_future(job) == alone
    assert await asyncio.wait_for(lm.sample(PROMPTS[0], seed=11, **args), timeout=60) == alone


async def test_errors_come_from_the_await_and_reach_only_their_caller():
    lm = MockAsyncLM(SizedTokenizer())
    bad = lm.next_token_logprobs([V])  # the call itself does not raise
    good = lm.next_token_logprobs([2])
    with pytest.raises(ValueError, match=f"token id {V} at position 0"):
        await bad
    assert torch.equal(await good, lm.logprobs_of([2]))
    lm.cleanup()
    closed = lm.next_token_logprobs([2])
    with pytest.raises(ClosedError):
        await closed


async def test_cancelling_one_call_harms_no_other_awaiter():
    slow = MockAsyncLM(SizedTokenizer(), timeout=0.05, flush="timer")  # a batch after 50 ms
    try:
        first = asyncio.ensure_future(slow.next_token_logprobs([6]))
        second = asyncio.ensure_future(slow.next_token_logprobs([6]))
        other = asyncio.ensure_future(slow.next_token_logprobs([6, 6]))
        await asyncio.sleep(0)
        first.cancel()
        assert torch.equal(await second, slow.logprobs_of([6]))
        assert torch.equal(await other, slow.logprobs_of([6, 6]))
        with pytest.raises(asyncio.CancelledError):
            await first
        assert slow.stats()["num_evaluated"] == 2
    finally:
        slow.cleanup()


async def test_with_an_output_cache_the_call_hits_the_cache():
    cached = MockAsyncLM(SizedTokenizer(), cache_size=8)
    try:
        assert torch.equal(await cached.next_token_logprobs([9]), cached.logprobs_of([9]))
        assert torch.equal(await cached.next_token_logprobs([9]), cached.logprobs_of([9]))
        assert cached.stats()["cache_hits"] == 1
    finally:
        cached.cleanup()


def test_a_program_that_leaves_requests_behind_logs_no_unretrieved_error(caplog):
    # asyncio.run of a program that drops some calls, cancels a task and leaves another one
    # pending; then a new loop. Nothing may log "exception was never retrieved".
    import gc
    import logging

    lm = MockAsyncLM(SizedTokenizer(), timeout=0.05, flush="timer")  # no batch before the close
    messages = []

    async def leave_requests():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: messages.append(context["message"]))
        dropped = [lm.next_token_logprobs([i + 1]) for i in range(3)]
        tasks = [asyncio.ensure_future(lm.next_token_logprobs([i + 1, 2])) for i in range(2)]
        await asyncio.sleep(0)
        tasks[0].cancel()
        for call in dropped:
            call.close()

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio.run(leave_requests())
            assert torch.equal(asyncio.run(lm.next_token_logprobs([5])), lm.logprobs_of([5]))
            gc.collect()
        logged = messages + [record.getMessage() for record in caplog.records]
        assert not [m for m in logged if "never retrieved" in m]
    finally:
        lm.cleanup()
