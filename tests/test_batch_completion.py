"""Every route by which a batch ends, broken on purpose: its awaiters get an error, the queue
goes on.

A batch ends through a worker thread's job, an ``async def`` task, a loop future, or an
``evaluate`` run on the loop itself. Each test breaks one of them (a cancelled job, an
executor shut down under a queued batch, a bad return value, an exception that cannot be
copied, a cancelled evaluation, an executor that refuses work) and checks that the batch's
awaiters fail and the next request is served. Every wait is bounded: a broken completion
path would otherwise hang the test instead of failing it. Last, the queue's modules depend on
no batcher module (the import goes one way).
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import pathlib
import threading

import pytest

import genlm_backend
from genlm_backend.batching import INLINE, Batcher
from genlm_backend.engine_thread import EngineThread
from genlm_backend.exceptions import ClosedError, EngineError


def times_ten(keys):
    return [k * 10 for k in keys]


BOUND_S = 5.0


def _bounded(awaitable):
    return asyncio.wait_for(awaitable, BOUND_S)


def _batcher_on_route(route: str, results_of) -> Batcher:
    """A batcher whose evaluate returns ``results_of(keys)`` through one completion route:
    a worker thread, the loop's thread, an ``async def``, or a loop future."""
    if route == "thread":
        return Batcher(results_of, timeout=0.0)
    if route == "inline":
        return Batcher(results_of, timeout=0.0, executor=INLINE)
    if route == "async":

        async def evaluate(keys):
            await asyncio.sleep(0)
            return results_of(keys)

        return Batcher(evaluate, timeout=0.0)

    def evaluate_later(keys):
        future = asyncio.get_running_loop().create_future()
        future.get_loop().call_soon(lambda: future.set_result(results_of(keys)))
        return future

    return Batcher(evaluate_later, timeout=0.0, executor=INLINE)


ROUTES = ["thread", "inline", "async", "future"]


class RecordingExecutor(concurrent.futures.ThreadPoolExecutor):
    """One worker thread; keeps every job it is given, so a test can cancel one."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.jobs: list[concurrent.futures.Future] = []

    def submit(self, fn, /, *args, **kwargs):
        job = super().submit(fn, *args, **kwargs)
        self.jobs.append(job)
        return job


async def test_a_cancelled_executor_job_fails_its_batch_and_the_next_batch_runs():
    executor, gate = RecordingExecutor(), threading.Event()
    executor.submit(gate.wait, 10)  # the worker is busy: the batch's job waits in the queue
    batcher = Batcher(times_ten, timeout=0.0, executor=executor)
    waiter = asyncio.ensure_future(batcher.submit(1))
    while len(executor.jobs) < 2:
        await asyncio.sleep(0.001)
    assert executor.jobs[1].cancel()
    with pytest.raises(ClosedError, match="cancelled"):
        await _bounded(waiter)
    gate.set()
    assert await _bounded(batcher.submit(2)) == 20
    batcher.close()
    executor.shutdown()


@pytest.mark.parametrize(
    "make_executor", [lambda: concurrent.futures.ThreadPoolExecutor(1), EngineThread]
)
async def test_a_shared_executor_shut_down_under_a_queued_batch_fails_it_and_later_requests(
    make_executor,
):
    executor, gate = make_executor(), threading.Event()
    executor.submit(gate.wait, 10)
    batcher = Batcher(times_ten, timeout=0.0, executor=executor)
    waiter = asyncio.ensure_future(batcher.submit(1))
    while batcher.stats.num_batches == 0:
        await asyncio.sleep(0.001)
    executor.shutdown(wait=False, cancel_futures=True)
    gate.set()
    with pytest.raises(ClosedError):
        await _bounded(waiter)
    with pytest.raises(ClosedError):
        await _bounded(batcher.submit(2))
    batcher.close()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("bad", ["generator", "int", "None", "too_many"])
async def test_a_bad_return_value_of_evaluate_fails_its_batch_and_the_next_batch_runs(route, bad):
    values = {
        "generator": lambda keys: (k for k in keys),
        "int": lambda keys: 7,
        "None": lambda keys: None,
        "too_many": lambda keys: [0] * (len(keys) + 1),
    }

    def results_of(keys):
        return values[bad](keys) if -1 in keys else [k * 10 for k in keys]

    batcher = _batcher_on_route(route, results_of)
    with pytest.raises(EngineError, match="evaluate returned"):
        await _bounded(batcher.submit(-1))
    assert await _bounded(asyncio.gather(batcher.submit(2), batcher.submit(3))) == [20, 30]
    assert batcher.stats.num_failed_batches == 1
    batcher.close()


class TwoArgumentError(Exception):
    """An exception that ``copy.copy`` cannot rebuild from its ``args``."""

    def __init__(self, key, why):
        super().__init__(f"key {key}: {why}")


@pytest.mark.parametrize("route", ROUTES)
async def test_an_exception_result_that_cannot_be_copied_still_reaches_every_awaiter(route):
    batcher = _batcher_on_route(
        route, lambda keys: [TwoArgumentError(k, "bad") if k < 0 else k for k in keys]
    )
    awaiters = (batcher.submit(-1) for _ in range(3))
    results = await _bounded(asyncio.gather(*awaiters, return_exceptions=True))
    assert all(isinstance(r, TwoArgumentError) and str(r) == "key -1: bad" for r in results)
    assert await _bounded(batcher.submit(4)) == 4
    batcher.close()


@pytest.mark.parametrize("route", ["inline", "async", "future"])
async def test_a_cancelled_evaluation_on_the_loop_fails_its_batch_and_the_next_batch_runs(route):
    def results_of(keys):
        if -1 in keys:  # as if the engine's own future of this batch was cancelled
            cancelled = asyncio.get_running_loop().create_future()
            cancelled.cancel()
            return cancelled.result()
        return [k * 10 for k in keys]

    if route == "future":  # the loop future handed back is itself cancelled

        def evaluate(keys):
            future = asyncio.get_running_loop().create_future()
            settle = future.cancel if -1 in keys else lambda: future.set_result(results_of(keys))
            future.get_loop().call_soon(settle)
            return future

        batcher = Batcher(evaluate, timeout=0.0, executor=INLINE)
    else:
        batcher = _batcher_on_route(route, results_of)
    with pytest.raises(ClosedError, match="cancelled"):
        await _bounded(batcher.submit(-1))
    assert await _bounded(batcher.submit(2)) == 20
    batcher.close()


class BrokenExecutor(concurrent.futures.Executor):
    def submit(self, fn, /, *args, **kwargs):
        raise OSError("the executor broke")


async def test_an_executor_that_raises_on_submit_fails_the_batch_not_the_queue():
    batcher = Batcher(times_ten, timeout=0.0, executor=BrokenExecutor())
    for key in (1, 2):  # the second request is not stuck behind the first
        with pytest.raises(EngineError, match="the executor broke"):
            await _bounded(batcher.submit(key))
    batcher.close()


async def test_a_plain_evaluate_runs_off_the_loop_thread():
    threads = []
    batcher = Batcher(
        lambda keys: threads.append(threading.current_thread()) or list(keys), timeout=0.0
    )
    assert await _bounded(batcher.submit(1)) == 1
    assert threads and threads[0] is not threading.current_thread()
    batcher.close()


def test_the_queue_modules_do_not_import_the_batcher():
    """``batching`` imports the queue; the queue knows a batcher only by its protocol."""
    for name in ("_batch_queue.py", "_batch_results.py"):
        tree = ast.parse((pathlib.Path(genlm_backend.__file__).parent / name).read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {"batching", "genlm_backend.batching"} & imported, name


def test_requests_left_on_a_closed_loop_get_closed_error_and_log_nothing():
    # Nobody can await a future of a closed loop: it is failed when the batcher next runs on
    # another loop, without asyncio's "exception was never retrieved" at its collection.
    import gc

    batcher = Batcher(times_ten, timeout=0.05, flush="timer")  # no batch before the close
    messages = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda loop, context: messages.append(context["message"]))

    async def leave_queued():
        return [batcher.enqueue(k) for k in range(3)]

    futures = loop.run_until_complete(leave_queued())
    loop.close()
    assert asyncio.run(_bounded(batcher.submit(4))) == 40  # another loop
    assert isinstance(futures[0].exception(), ClosedError)
    del futures
    gc.collect()
    assert messages == []
