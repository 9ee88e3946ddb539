"""The one thread that drives a model's engine, as a ``concurrent.futures.Executor``.

Like a one-worker ``ThreadPoolExecutor``, plus what lets the vLLM backend keep its engine
requests running between lockstep steps: code running *on* the thread (inside an engine
step) may :meth:`~EngineThread.hold` — wait for the next batch's plan without leaving the
step — and tasks submitted with :meth:`~EngineThread.submit_hold_safe` run inline during
such a wait. Any other task ends the wait: the step finishes and that task runs next.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EngineThread"]


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
    """A single worker thread that runs submitted calls in order (daemon, started at once)."""

    def __init__(self, name: str = "genlm-engine"):
        self._queue: collections.deque[_Task] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        return self._put(_Task(fn, args, kwargs, False), front=False)

    def submit_hold_safe(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Submits a call that may also run inline while the thread holds (see :meth:`hold`):
        it must not step the engine."""
        return self._put(_Task(fn, args, kwargs, True), front=False)

    def submit_next(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Submits a call that runs before everything already queued."""
        return self._put(_Task(fn, args, kwargs, False), front=True)

    def _put(self, task: _Task, front: bool) -> concurrent.futures.Future:
        with self._cond:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if front:
                self._queue.appendleft(task)
            else:
                self._queue.append(task)
            self._cond.notify_all()
        return task.future

    @property
    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def hold(self, until: Callable[[], bool], timeout: float) -> bool:
        """Waits on the engine thread itself until ``until()`` is true, running hold-safe
        tasks inline as they come; True once it is.

        Returns False at once when the next queued task is not hold-safe (other work wants
        the engine), and after ``timeout`` seconds or a shutdown.
        """
        if not self.on_thread:
            raise RuntimeError("EngineThread.hold runs on the engine thread only")
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cond.wait(left)
                if self._closed or not self._queue[0].hold_safe:
                    return False
                task = self._queue.popleft()
            task.run()
            if until():
                return True

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
            task.run()
            del task

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._closed = True
            if cancel_futures:
                while self._queue:
                    self._queue.popleft().future.cancel()
            self._cond.notify_all()
        if wait and not self.on_thread:
            self._thread.join()
