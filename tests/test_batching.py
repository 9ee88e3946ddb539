"""The batcher's guarantees, each against a hand-computed expectation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genlm_backend._batch_queue import call_when_idle
from genlm_backend.batching import INLINE, Batcher
from genlm_backend.exceptions import ClosedError, EngineError, RequestDroppedError


class Recorder:
    """An evaluate function that records its batches and returns key * 10 as a tensor."""

    def __init__(
        self, *, delay: float = 0.0, fail_batches: set[int] = frozenset(), bad_keys=frozenset()
    ):
        self.batches: list[list] = []
        self.delay = delay
        self.fail_batches = set(fail_batches)
        self.bad_keys = set(bad_keys)
        self.lock = threading.Lock()

    def __call__(self, keys):
        with self.lock:
            index = len(self.batches)
            self.batches.append(list(keys))
        if self.delay:
            time.sleep(self.delay)
        if index in self.fail_batches:
            raise OSError(f"injected failure in batch {index}")
        return [
            ValueError(f"bad key {k}") if k in self.bad_keys else torch.tensor([k * 10.0])
            for k in keys
        ]


async def test_concurrent_submits_form_one_batch():
    rec = Recorder()
    batcher = Batcher(rec, max_batch_size=100, timeout=10.0)
    results = await asyncio.gather(*(batcher.submit(k) for k in range(7)))
    assert [float(r) for r in results] == [k * 10.0 for k in range(7)]
    assert rec.batches == [list(range(7))]
    batcher.close()


async def test_identical_keys_run_once_and_each_awaiter_owns_its_result():
    rec = Recorder()
    batcher = Batcher(rec, timeout=10.0)
    a, b, c = await asyncio.gather(batcher.submit(3), batcher.submit(3), batcher.submit(4))
    assert rec.batches == [[3, 4]]
    a.add_(1000.0)  # mutating one caller's result must not reach the other
    assert float(b) == 30.0 and float(c) == 40.0
    assert batcher.stats.num_deduplicated == 1
    batcher.close()


async def test_request_identical_to_a_running_one_joins_it():
    rec = Recorder(delay=0.2)
    batcher = Batcher(rec, timeout=0.0)
    first = asyncio.ensure_future(batcher.submit(5))
    while not rec.batches:  # wait until key 5 is being evaluated
        await asyncio.sleep(0.01)
    second = await batcher.submit(5)
    assert float(await first) == 50.0 and float(second) == 50.0
    assert rec.batches == [[5]]
    assert batcher.stats.num_joined == 1
    batcher.close()


async def test_full_batch_runs_at_once_and_never_exceeds_the_limit():
    rec = Recorder()
    batcher = Batcher(rec, max_batch_size=3, timeout=30.0, flush="timer")
    start = time.perf_counter()
    await asyncio.gather(*(batcher.submit(k) for k in range(9)))
    assert time.perf_counter() - start < 5.0  # three full batches, no 30 s timer
    assert [len(b) for b in rec.batches] == [3, 3, 3]
    assert sorted(k for b in rec.batches for k in b) == list(range(9))
    batcher.close()


async def test_timer_flush_waits_for_the_timeout():
    rec = Recorder()
    batcher = Batcher(rec, max_batch_size=100, timeout=0.3, flush="timer")
    start = time.perf_counter()
    await batcher.submit(1)
    assert time.perf_counter() - start >= 0.29
    batcher.close()


async def test_idle_flush_runs_without_waiting_for_the_timeout():
    rec = Recorder()
    batcher = Batcher(rec, max_batch_size=100, timeout=60.0, flush="idle")

    async def particle(i):
        for step in range(5):
            await asyncio.sleep(0)  # some work between requests
            await batcher.submit(i * 100 + step)

    await asyncio.wait_for(asyncio.gather(*(particle(i) for i in range(8))), timeout=10.0)
    # Lockstep: every step of the 8 particles is one batch of 8.
    assert [len(b) for b in rec.batches] == [8] * 5
    batcher.close()


async def test_call_when_idle_waits_for_the_work_ready_on_the_loop():
    loop = asyncio.get_running_loop()
    order = []

    def chain(n):
        order.append(n)
        if n < 3:
            loop.call_soon(chain, n + 1)

    loop.call_soon(chain, 0)
    call_when_idle(loop, lambda: order.append("idle"), max_wait=60.0)
    await asyncio.sleep(0.05)
    assert order == [0, 1, 2, 3, "idle"]


async def test_call_when_idle_lets_the_batches_of_that_moment_start_first():
    # A waiter that asks for work once the loop is idle, before the other particles' batch
    # is queued: that work must come after the batch starts (and after the work its results
    # make ready), or the batch's requests miss it.
    loop = asyncio.get_running_loop()
    order = []

    def evaluate(keys):
        order.append(("batch", list(keys)))
        return [torch.tensor([float(k)]) for k in keys]

    batcher = Batcher(evaluate, timeout=60.0, executor=INLINE)

    async def particle(i):
        await batcher.submit(i)
        order.append(("resumed", i))

    call_when_idle(loop, lambda: order.append("idle"), max_wait=60.0)
    tasks = [asyncio.ensure_future(particle(i)) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
    await asyncio.sleep(0.01)
    assert order == [("batch", [0, 1, 2]), ("resumed", 0), ("resumed", 1), ("resumed", 2), "idle"]
    batcher.close()


async def test_call_when_idle_does_not_wait_forever_for_a_loop_that_never_idles():
    loop = asyncio.get_running_loop()
    called, spins = asyncio.Event(), 0

    def spin():
        nonlocal spins
        spins += 1
        if not called.is_set():
            loop.call_soon(spin)

    loop.call_soon(spin)
    call_when_idle(loop, called.set, max_wait=0.05)
    await asyncio.wait_for(called.wait(), 10.0)
    assert spins > 1  # it waited while the loop was busy, then gave up waiting


async def test_two_idle_batchers_do_not_hold_each_other_back():
    one, two = Batcher(Recorder(), timeout=60.0), Batcher(Recorder(), timeout=60.0)
    results = await asyncio.wait_for(asyncio.gather(one.submit(1), two.submit(2)), timeout=10.0)
    assert [float(r) for r in results] == [10.0, 20.0]
    one.close()
    two.close()


async def test_an_exception_returned_for_one_key_fails_only_its_awaiters():
    batcher = Batcher(Recorder(bad_keys={2}), timeout=10.0)
    results = await asyncio.gather(
        *(batcher.submit(k) for k in (1, 2, 2, 3)), return_exceptions=True
    )
    assert float(results[0]) == 10.0 and float(results[3]) == 30.0
    assert all(isinstance(r, ValueError) for r in results[1:3])
    assert results[1] is not results[2]
    batcher.close()


async def test_engine_error_fails_exactly_that_batch_and_the_next_one_works():
    rec = Recorder(fail_batches={0})
    batcher = Batcher(rec, timeout=10.0)
    failed = await asyncio.gather(*(batcher.submit(k) for k in (1, 2, 2)), return_exceptions=True)
    assert all(isinstance(r, EngineError) for r in failed)
    assert len({id(r) for r in failed}) == 3  # each awaiter has its own error
    assert isinstance(failed[0].__cause__, OSError)
    ok = await asyncio.gather(*(batcher.submit(k) for k in (1, 2)))
    assert [float(r) for r in ok] == [10.0, 20.0]
    assert batcher.stats.num_failed_batches == 1
    batcher.close()


async def test_wrong_number_of_results_is_an_engine_error():
    batcher = Batcher(lambda keys: [0] * (len(keys) + 1), timeout=10.0)
    with pytest.raises(EngineError, match="results for"):
        await batcher.submit(1)
    batcher.close()


async def test_cancelling_one_awaiter_leaves_the_others_alone():
    rec = Recorder()
    batcher = Batcher(rec, timeout=0.05, flush="timer")
    keep = asyncio.ensure_future(batcher.submit(1))
    drop_shared = asyncio.ensure_future(batcher.submit(1))
    drop_alone = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    drop_shared.cancel()
    drop_alone.cancel()
    assert float(await keep) == 10.0
    assert drop_shared.cancelled() and drop_alone.cancelled()
    assert rec.batches == [[1]]  # key 2 lost its only awaiter before it ran
    batcher.close()


class EqualsAnything:
    """A key equal to every object (as some test doubles are), with a fixed hash."""

    def __hash__(self):
        return 7

    def __eq__(self, other):
        return True


async def test_cancelling_one_awaiter_of_a_key_equal_to_anything_leaves_the_other_alone():
    batcher = Batcher(lambda keys: ["row"] * len(keys), timeout=0.05, flush="timer")
    key = EqualsAnything()
    keep = asyncio.ensure_future(batcher.submit(key))
    drop = asyncio.ensure_future(batcher.submit(key))
    await asyncio.sleep(0)
    drop.cancel()
    assert await asyncio.wait_for(keep, 5) == "row"
    assert drop.cancelled()
    batcher.close()


async def test_a_cancelled_enqueued_key_is_dropped_before_it_runs():
    rec = Recorder()
    batcher = Batcher(rec, timeout=0.05, flush="timer")

    async def caller(key):
        return await batcher.enqueue(key)

    keep = asyncio.ensure_future(caller(1))
    drop_shared = asyncio.ensure_future(caller(1))
    drop_alone = asyncio.ensure_future(caller(2))
    await asyncio.sleep(0)
    drop_shared.cancel()
    drop_alone.cancel()
    assert float(await keep) == 10.0
    assert drop_shared.cancelled() and drop_alone.cancelled()
    assert rec.batches == [[1]]  # key 2 lost its only awaiter before it ran: never evaluated
    assert batcher.stats.num_evaluated == 1
    batcher.close()
    with pytest.raises(ClosedError):
        batcher.enqueue(3)


async def test_cancelling_during_evaluation_leaves_the_others_alone():
    rec = Recorder(delay=0.2)
    batcher = Batcher(rec, timeout=0.0)
    tasks = [asyncio.ensure_future(batcher.submit(k)) for k in (1, 1, 2)]
    while not rec.batches:
        await asyncio.sleep(0.01)
    tasks[0].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert float(results[1]) == 10.0 and float(results[2]) == 20.0
    batcher.close()


async def test_reset_fails_queued_waiters_and_lets_running_ones_finish():
    rec = Recorder(delay=0.3)
    batcher = Batcher(rec, timeout=0.0, max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(1))
    while not rec.batches:
        await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    batcher.reset()
    with pytest.raises(RequestDroppedError):
        await queued
    assert float(await running) == 10.0
    assert float(await batcher.submit(3)) == 30.0  # still usable
    batcher.close()


async def test_close_fails_every_waiter_and_refuses_new_ones():
    rec = Recorder(delay=0.3)
    batcher = Batcher(rec, timeout=0.0, max_batch_size=1)
    running = asyncio.ensure_future(batcher.submit(1))
    while not rec.batches:
        await asyncio.sleep(0.01)
    queued = asyncio.ensure_future(batcher.submit(2))
    await asyncio.sleep(0)
    batcher.close()
    batcher.close()  # idempotent
    for fut in (running, queued):
        with pytest.raises(ClosedError):
            await fut
    with pytest.raises(ClosedError):
        await batcher.submit(3)


def test_works_across_repeated_asyncio_run_calls():
    rec = Recorder()
    batcher = Batcher(rec, timeout=10.0)
    for round_ in range(3):
        results = asyncio.run(_gather(batcher, [round_, round_ + 10]))
        assert [float(r) for r in results] == [round_ * 10.0, (round_ + 10) * 10.0]
    batcher.close()


async def _gather(batcher, keys):
    return await asyncio.gather(*(batcher.submit(k) for k in keys))


def test_waiters_of_a_closed_loop_are_failed_not_left_pending():
    rec = Recorder()
    batcher = Batcher(rec, timeout=0.5, flush="timer")
    loop = asyncio.new_event_loop()
    task = loop.create_task(batcher.submit(1))
    loop.run_until_complete(asyncio.sleep(0.01))  # queued, waiting for its 0.5 s timer
    loop.close()  # closed without cancelling the task
    queue_futures = [
        w for q in batcher._queues.values() for e in q.pending.values() for w in e[2:]
    ]
    assert queue_futures and not any(f.done() for f in queue_futures)
    assert float(asyncio.run(_gather(batcher, [2]))[0]) == 20.0  # a new loop works...
    assert all(f.done() for f in queue_futures)  # ...and the old loop's waiters were failed
    assert isinstance(queue_futures[0].exception(), ClosedError)
    assert not task.done() or task.cancelled() or task.exception() is not None
    batcher.close()


@pytest.mark.parametrize("fails", [False, True])
def test_a_batch_that_ends_after_its_loop_closed_counts_as_failed_only_if_it_failed(fails):
    """Early-delivered results can end a loop while its batch still runs on the engine thread."""
    release = threading.Event()

    def evaluate(keys):
        release.wait(5)
        if fails:
            raise OSError("boom")
        return [k * 2 for k in keys]

    batcher = Batcher(evaluate, timeout=10.0)

    async def submit_and_leave():
        asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0.05)  # the batch is on the worker thread now

    asyncio.run(submit_and_leave())  # cancels the waiter and closes the loop
    release.set()
    deadline = time.monotonic() + 5
    while (
        batcher.stats.evaluate_s == 0
        and batcher.stats.num_failed_batches == 0
        and time.monotonic() < deadline
    ):
        time.sleep(0.01)
    assert batcher.stats.num_batches == 1
    assert batcher.stats.num_failed_batches == int(fails)
    batcher.close()


async def test_async_evaluate_is_awaited_on_the_loop():
    seen = []

    async def evaluate(keys):
        seen.append(list(keys))
        await asyncio.sleep(0)
        return [k + 1 for k in keys]

    batcher = Batcher(evaluate, timeout=10.0)
    assert await asyncio.gather(batcher.submit(1), batcher.submit(2), batcher.submit(1)) == [
        2,
        3,
        2,
    ]
    assert seen == [[1, 2]]
    batcher.close()


async def test_inline_evaluate_runs_on_the_loop_thread_and_routes_errors():
    threads = []

    def evaluate(keys):
        threads.append(threading.current_thread())
        if 0 in keys:
            raise OSError("boom")
        return [k * 2 for k in keys]

    batcher = Batcher(evaluate, timeout=10.0, executor=INLINE)
    assert await asyncio.gather(batcher.submit(1), batcher.submit(2)) == [2, 4]
    with pytest.raises(EngineError):
        await batcher.submit(0)
    assert await batcher.submit(3) == 6
    assert set(threads) == {threading.current_thread()}
    batcher.close()


def test_bad_configuration_is_refused():
    for kwargs in ({"max_batch_size": 0}, {"timeout": -1}, {"flush": "sometimes"}):
        with pytest.raises(ValueError):
            Batcher(lambda keys: keys, **kwargs)


# ---- property test: random interleavings ------------------------------------------------

ops = st.lists(
    st.tuples(
        st.integers(0, 5),  # key
        st.integers(0, 4),  # loop iterations before submitting
        st.one_of(st.none(), st.integers(0, 6)),  # loop iterations before cancelling, if any
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    script=ops,
    max_batch_size=st.integers(1, 6),
    flush=st.sampled_from(["idle", "timer"]),
    fail_batches=st.sets(st.integers(0, 6), max_size=3),
    bad_keys=st.sets(st.integers(0, 5), max_size=2),
    mode=st.sampled_from(["thread", "inline", "async"]),
    use_enqueue=st.booleans(),
)
def test_every_awaiter_resolves_exactly_once_and_correctly(
    script, max_batch_size, flush, fail_batches, bad_keys, mode, use_enqueue
):
    rec = Recorder(fail_batches=fail_batches, bad_keys=bad_keys)
    evaluate, executor = rec, INLINE if mode == "inline" else None
    if mode == "async":

        async def evaluate(keys):
            await asyncio.sleep(0)
            return rec(keys)

    batcher = Batcher(
        evaluate, max_batch_size=max_batch_size, timeout=0.005, flush=flush, executor=executor
    )

    async def one(key, delay):
        for _ in range(delay):
            await asyncio.sleep(0)
        if use_enqueue:  # the future awaited by the caller's own coroutine (cancelled with it)
            return await batcher.enqueue(key)
        return await batcher.submit(key)

    async def main():
        tasks = [asyncio.ensure_future(one(key, delay)) for key, delay, _ in script]
        cancel_at = {i: c for i, (_, _, c) in enumerate(script) if c is not None}
        for step in range(8):
            for i, c in cancel_at.items():
                if c == step:
                    tasks[i].cancel()
            await asyncio.sleep(0)
        _, pending = await asyncio.wait(tasks, timeout=10.0)
        assert not pending, "an awaiter was left hanging"
        return tasks

    tasks = asyncio.run(main())
    failed_keys = {k for i, b in enumerate(rec.batches) if i in fail_batches for k in b}
    for (key, _, cancel), task in zip(script, tasks):
        if task.cancelled():
            assert cancel is not None
            continue
        exc = task.exception()
        if exc is None:
            assert key not in bad_keys and float(task.result()) == key * 10.0
        elif isinstance(exc, EngineError):
            assert key in failed_keys
        else:
            assert isinstance(exc, ValueError) and key in bad_keys
    for batch in rec.batches:
        assert len(batch) == len(set(batch)) <= max_batch_size
    batcher.close()
