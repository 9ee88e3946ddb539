"""The one thread that drives a model's engine, as a ``concurrent.futures.Executor``.

Like a one-worker ``ThreadPoolExecutor``, plus what lets the vLLM backend keep its engine
requests running between lockstep steps: code running *on* the thread (inside an engine
step) may :meth:`~EngineThread.hold` — wait for the next batch's plan without leaving the
step — and tasks submitted with :meth:`~EngineThread.submit_hold_safe` run inline during
such a wait. Any other task ends the wait: the step finishes and that task runs next.

Engines that share process-wide state (vLLM's in-process engines) give their threads one
:class:`TurnLock`: a thread holds it while it runs a task, lets it go while it holds, and
passes the turn between engine steps (:meth:`~EngineThread.pass_turn`), so that their
engine calls never overlap and none waits for another's whole batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EngineThread", "TurnLock"]


class TurnLock:
    """A lock for threads that take turns: its holder may let the threads that wait for it
    go first between two pieces of work (:meth:`pass_turn`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = threading.Lock()  # guards the two counters
        self._waiting = 0
        self._taken = 0

    def acquire(self) -> bool:
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1
            self._taken += 1
        return True

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def pass_turn(self, timeout: float = 0.05) -> None:
        """By the holder: where other threads wait, lets one of them take the lock (waiting
        at most ``timeout`` seconds for it to), then waits for the lock again."""
        if not self._waiting:
            return
        taken = self._taken
        self._lock.release()
        deadline = time.monotonic() + timeout
        while self._taken == taken and time.monotonic() < deadline:
            time.sleep(0.0002)
        self.acquire()


class _Task:
    __slots__ = ("future", "fn", "args", "kwargs", "hold_safe")

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, hold_safe: bool):
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.fn, self.args, self.kwargs, self.hold_safe = fn, args, kwargs, hold_safe

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


class EngineThread(concurrent.futures.Executor):
    """A single worker thread that runs submitted calls in order (daemon, started at once).

    Tasks wait in a deque; the worker sleeps on a plain lock used as a wake-up signal (a
    submit releases it), which hands a task over faster than a ``threading.Condition``:
    lockstep sampling hands the engine thread a batch every step.
    """

    def __init__(self, name: str = "genlm-engine", lock: TurnLock | None = None):
        self._lock = lock
        self._last: _Task | None = None  # runs once the queue is done after a shutdown
        self._queue: collections.deque[_Task] = collections.deque()
        self._wakeup = threading.Lock()
        self._wakeup.acquire()  # released: "look at the queue"
        self._closed = False
        # Held from a submit's closed check to its enqueue, and by a shutdown while it closes:
        # a task is then either refused or queued before the worker can see "closed, empty".
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._put(_Task(fn, args, kwargs, False), front=False)

    def submit_hold_safe(
        self, fn: Callable, /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        """Submits a call that may also run inline while the thread holds (see :meth:`hold`):
        it must not step the engine."""
        return self._put(_Task(fn, args, kwargs, True), front=False)

    def submit_next(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Submits a call that runs before everything already queued."""
        return self._put(_Task(fn, args, kwargs, False), front=True)

    def _put(self, task: _Task, front: bool) -> concurrent.futures.Future:
        with self._closing:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if front:
                self._queue.appendleft(task)
            else:
                self._queue.append(task)
        self._wake()
        return task.future

    def _wake(self) -> None:
        try:
            self._wakeup.release()
        except RuntimeError:  # released already, not looked at yet: the worker will see the task
            pass

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def hold(self, until: Callable[[], bool], timeout: float) -> bool:
        """Waits on the engine thread itself until ``until()`` is true, running hold-safe
        tasks inline as they come; True once it is.

        Returns False at once when the next queued task is not hold-safe (other work wants
        the engine), and after ``timeout`` seconds or a shutdown. The thread's ``lock`` is
        let go while it waits (other engines' threads run meanwhile) and held again to run a
        task and before this returns.
        """
        if not self.on_thread:
            raise RuntimeError("EngineThread.hold runs on the engine thread only")
        lock = self._lock
        if lock is None:
            return self._hold(until, timeout)
        lock.release()
        try:
            return self._hold(until, timeout)
        finally:
            lock.acquire()

    def pass_turn(self) -> None:
        """On the thread, between two engine steps of a task: lets the threads that share
        its lock and wait for it run first (nothing without a lock or waiters)."""
        if self._lock is not None:
            self._lock.pass_turn()

    def _hold(self, until: Callable[[], bool], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        queue = self._queue
        while True:
            if self._closed:
                return False
            if queue:
                try:
                    if not queue[0].hold_safe:
                        return False
                    task = queue.popleft()
                except IndexError:  # emptied by a shutdown meanwhile
                    continue
                self._run(task)
                if until():
                    return True
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._wakeup.acquire(timeout=left)

    def _run(self, task: _Task) -> None:
        if self._lock is None:
            task.run()
        else:
            with self._lock:
                task.run()

    def _work(self) -> None:
        queue = self._queue
        while True:
            if queue:
                try:
                    task = queue.popleft()
                except IndexError:  # emptied by a shutdown meanwhile
                    continue
                self._run(task)
                del task
            elif self._closed:
                if self._last is not None:
                    self._run(self._last)
                return
            else:
                self._wakeup.acquire()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False,
                 last: Callable[[], Any] | None = None) -> concurrent.futures.Future | None:
        """Refuses new tasks; the thread ends once the queued ones ran (``cancel_futures``:
        they are cancelled instead, except the one running).

        ``last``: a call the thread makes before it ends, after every other task (given to
        the first shutdown only; a later shutdown does not cancel it); its future is
        returned. ``wait``: returns once the thread has ended (not when called on it).
        """
        with self._closing:
            first = not self._closed
            if first and last is not None:  # before "closed": the worker reads it after that
                self._last = _Task(last, (), {}, False)
            self._closed = True
        last_future = self._last.future if first and self._last is not None else None
        if cancel_futures:
            while self._queue:
                try:
                    self._queue.popleft().future.cancel()
                except IndexError:  # taken by the worker meanwhile
                    break
        self._wake()
        if wait and not self.on_thread:
            self._thread.join()
        return last_future
