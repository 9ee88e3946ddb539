"""The engine thread: calls run in order on one thread; a hold runs hold-safe calls inline."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

import pytest

from genlm_backend.engine_thread import EngineThread, TurnLock


@pytest.fixture
def engine_thread():
    thread = EngineThread("genlm-test-engine")
    yield thread
    thread.shutdown(wait=True)


def test_calls_run_in_submission_order_on_one_thread(engine_thread):
    seen = []
    futures = [
        engine_thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        for i in range(200)
    ]
    for future in futures:
        future.result(timeout=10)
    assert [i for i, _ in seen] == list(range(200))
    assert {name for _, name in seen} == {"genlm-test-engine"}


def test_submit_next_jumps_the_queue_and_errors_reach_the_caller(engine_thread):
    gate, order = threading.Event(), []
    engine_thread.submit(gate.wait, 10)
    later = engine_thread.submit(order.append, "later")
    first = engine_thread.submit_next(order.append, "first")
    failing = engine_thread.submit(lambda: 1 / 0)
    gate.set()
    later.result(timeout=10), first.result(timeout=10)
    assert order == ["first", "later"]
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)


def test_a_hold_runs_hold_safe_calls_inline_until_done(engine_thread):
    decided, log = [], []

    def step():  # stands for an engine step that waits for the next batch's plan
        held = engine_thread.hold(lambda: bool(decided), timeout=10)
        log.append(("hold ended", held))

    engine_thread.submit(step)
    time.sleep(0.05)
    engine_thread.submit_hold_safe(lambda: log.append("not yet")).result(timeout=10)
    engine_thread.submit_hold_safe(lambda: (log.append("plan"), decided.append(1))).result(
        timeout=10
    )
    engine_thread.submit(lambda: None).result(timeout=10)
    assert log == ["not yet", "plan", ("hold ended", True)]


def test_other_work_or_the_timeout_ends_a_hold(engine_thread):
    results = []
    engine_thread.submit(lambda: results.append(engine_thread.hold(lambda: False, timeout=10)))
    time.sleep(0.05)
    start = time.monotonic()
    engine_thread.submit(lambda: results.append("other work")).result(timeout=10)
    assert results == [False, "other work"] and time.monotonic() - start < 5
    start = time.monotonic()
    engine_thread.submit(
        lambda: results.append(engine_thread.hold(lambda: False, timeout=0.1))
    ).result(timeout=10)
    assert results[-1] is False and 0.09 < time.monotonic() - start < 5


def test_hold_is_refused_off_the_engine_thread(engine_thread):
    with pytest.raises(RuntimeError, match="engine thread only"):
        engine_thread.hold(lambda: True, timeout=1)


def test_shutdown_cancels_queued_calls_and_refuses_new_ones():
    thread = EngineThread()
    gate = threading.Event()
    thread.submit(gate.wait, 10)
    queued = [thread.submit(lambda: None) for _ in range(5)]
    thread.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert all(f.cancelled() for f in queued)
    with pytest.raises(RuntimeError):
        thread.submit(lambda: None)
    thread._thread.join(timeout=10)
    assert not thread._thread.is_alive()


def test_a_hold_ends_at_shutdown():
    thread = EngineThread()
    result = thread.submit(thread.hold, lambda: False, 30)
    time.sleep(0.05)
    start = time.monotonic()
    thread.shutdown(wait=True)
    assert result.result(timeout=5) is False and time.monotonic() - start < 5


def test_a_submit_racing_a_shutdown_is_run_or_cancelled_never_left_pending():
    """A shutdown that lands between a submit's closed check and its enqueue must still see
    the task: the worker may not exit and leave it pending forever."""
    thread = EngineThread()
    shutting = threading.Thread(
        target=thread.shutdown, kwargs={"wait": True, "cancel_futures": True}
    )

    class ShutdownDuringAppend(collections.deque):
        def append(self, task):
            shutting.start()
            shutting.join(timeout=0.5)  # completes here unless the enqueue holds off a shutdown
            super().append(task)

    thread._queue = ShutdownDuringAppend()
    future = thread.submit(lambda: "ran")
    shutting.join(timeout=10)
    try:
        assert future.result(timeout=5) == "ran"
    except concurrent.futures.CancelledError:
        pass  # cancelled by the shutdown: settled all the same
    assert not thread._thread.is_alive()


def test_threads_sharing_a_lock_run_one_task_at_a_time_and_a_hold_lets_it_go():
    """Two engine threads with one lock: their tasks never overlap, and while one holds (a
    step waiting for the next batch) the other runs; the holder has the lock again when its
    hold ends and while it runs a hold-safe task inline."""
    lock = TurnLock()
    first, second = EngineThread("first", lock), EngineThread("second", lock)
    running, overlaps, decided, log = [], [], [], []

    def task(name):
        running.append(name)
        if len(running) > 1:
            overlaps.append(list(running))
        time.sleep(0.002)
        running.remove(name)

    def step():
        log.append(("locked before hold", lock.locked()))
        held = first.hold(lambda: bool(decided), timeout=10)
        log.append(("hold ended", held, lock.locked()))

    try:
        futures = [t.submit(task, t._thread.name) for _ in range(50) for t in (first, second)]
        for future in futures:
            future.result(timeout=10)
        assert overlaps == []
        first.submit(step)
        time.sleep(0.05)
        second.submit(lambda: log.append("second ran during the hold")).result(timeout=5)
        plan = first.submit_hold_safe(
            lambda: (log.append(("inline", lock.locked())), decided.append(1)))
        plan.result(timeout=5)
        first.submit(lambda: None).result(timeout=5)
        assert log == [("locked before hold", True), "second ran during the hold", ("inline", True),
                       ("hold ended", True, True)]
        assert not lock.locked()
    finally:
        first.shutdown(wait=True)
        second.shutdown(wait=True)


def test_the_last_task_runs_once_on_the_thread_after_the_call_in_flight():
    """``shutdown(last=...)``: queued calls are cancelled, the one running finishes, then
    ``last`` runs on the thread, once; a second shutdown neither cancels nor repeats it."""
    thread = EngineThread("genlm-test-last")
    started, gate, calls = threading.Event(), threading.Event(), []
    running = thread.submit(lambda: (started.set(), gate.wait(10), calls.append("running")))
    assert started.wait(10)
    queued = thread.submit(calls.append, "queued")

    def last():
        calls.append(("last", threading.current_thread().name))

    done = thread.shutdown(wait=False, cancel_futures=True, last=last)
    again = thread.shutdown(wait=False, cancel_futures=True, last=lambda: calls.append("again"))
    assert again is None
    gate.set()
    done.result(timeout=10)
    thread._thread.join(timeout=10)
    assert running.done() and queued.cancelled()
    assert calls == ["running", ("last", "genlm-test-last")]


def test_a_long_task_passes_the_turn_between_its_steps_to_a_waiting_thread():
    """A task of many engine steps on one thread: another thread's tasks, which share its
    lock, run between two of its steps instead of after the whole task; without a waiter
    the turn is kept."""
    lock = TurnLock()
    first, second = EngineThread("first", lock), EngineThread("second", lock)
    log, started = [], threading.Event()

    def long_task():
        for step in range(40):
            log.append(("first", step))
            started.set()
            time.sleep(0.002)
            first.pass_turn()

    try:
        first.submit(lambda: [first.pass_turn() for _ in range(3)]).result(timeout=5)  # no waiter
        long = first.submit(long_task)
        assert started.wait(5)
        others = [second.submit(log.append, ("second", i)) for i in range(3)]
        for future in [*others, long]:
            future.result(timeout=10)
        last_step = log.index(("first", 39))
        assert all(log.index(("second", i)) < last_step for i in range(3)), log
        assert not lock.locked()
    finally:
        first.shutdown(wait=True)
        second.shutdown(wait=True)
