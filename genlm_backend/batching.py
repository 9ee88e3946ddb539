"""The one batching primitive under every backend and the async trie.

A :class:`Batcher` turns many concurrent ``await batcher.submit(key)`` calls into few calls
of one ``evaluate(keys) -> results`` function. A backend is then only "how to evaluate one
batch"; queueing, deduplication, flushing, error routing and cancellation live here.

When a batch runs:
    * as soon as ``max_batch_size`` distinct requests are queued;
    * ``timeout`` seconds after the first request of the batch was queued;
    * with ``flush="idle"`` (the default), as soon as the event loop has no other ready
      work: every task that could still add a request is waiting on something else, so
      waiting longer only adds latency. A lockstep sampler whose particles all await the
      model each step gets its batch one loop iteration after the last particle asks,
      instead of after a timer. ``flush="timer"`` keeps the timer-only behaviour.

What each awaiter gets:
    * identical keys queued together are evaluated once; a key identical to one that is
      already being evaluated joins that evaluation instead of queueing a new one;
    * every awaiter gets its own result object (extra awaiters of a shared result get a copy
      made by ``copy_result``, a clone for tensors), so no caller can mutate another's;
    * ``evaluate`` may return an exception instance in place of a result: only the awaiters
      of that key get it; if ``evaluate`` raises or returns something other than one
      result per key, each awaiter of that batch gets its own
      :class:`~genlm_backend.exceptions.EngineError` and the next batch runs as usual (a
      cancelled evaluation, e.g. a job of an executor shut down with ``cancel_futures``,
      gives :class:`~genlm_backend.exceptions.ClosedError` instead); no failure on the way
      back leaves an awaiter pending;
    * cancelling one awaiter removes only its own wait; a key nobody waits for any more is
      dropped from the queue before it reaches the engine.

One batch runs at a time per event loop. A plain function ``evaluate`` runs on a worker
thread (``executor``; pass the same executor to batchers that share one engine so their
calls never overlap), so the event loop stays responsive while the engine works; with
``executor=INLINE`` it runs on the event loop's own thread instead, which saves the thread
hand-off (about 0.1-0.2 ms a batch here) but blocks the loop while the engine works; such an
``evaluate`` may also return an ``asyncio.Future`` of the results (work handed elsewhere,
resolved on this loop: no task, no extra turns of the loop); an ``async def`` evaluate is
awaited on the loop. State is kept per event loop, so the batcher
keeps working when ``asyncio.run`` is called repeatedly or a notebook changes loops; waiters
of a loop that was closed under them are failed, never left pending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import inspect
import threading
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._batch_queue import LoopQueue
from .exceptions import ClosedError, RequestDroppedError

__all__ = ["Batcher", "BatcherStats", "INLINE", "private_copy"]

INLINE = "inline"
"""Pass as ``executor`` to run a plain ``evaluate`` on the event loop's thread."""

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

Evaluate = Callable[[list], "Sequence[Any] | Awaitable[Sequence[Any]]"]

def private_copy(value: Any) -> Any:
    """Returns a copy that shares no mutable storage with ``value`` (tensors are cloned)."""
    clone = getattr(value, "clone", None)  # torch.Tensor
    if callable(clone):
        return clone()
    return copy.deepcopy(value)


@dataclass
class BatcherStats:
    """Counters of one batcher, summed over every event loop it served.

    Attributes:
        num_requests: calls of ``submit``.
        num_batches: calls of ``evaluate``.
        num_evaluated: keys passed to ``evaluate`` (sum of batch sizes).
        num_deduplicated: requests that shared a key already queued.
        num_joined: requests that joined a key already being evaluated.
        num_failed_batches: batches whose awaiters all got an error: ``evaluate`` raised,
            returned something other than one result per key, or was cancelled.
        queue_wait_s: total seconds between a key's queueing and its batch's start.
        evaluate_s: total seconds spent inside ``evaluate``.
    """

    num_requests: int = 0
    num_batches: int = 0
    num_evaluated: int = 0
    num_deduplicated: int = 0
    num_joined: int = 0
    num_failed_batches: int = 0
    queue_wait_s: float = 0.0
    evaluate_s: float = 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.num_evaluated / self.num_batches if self.num_batches else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["mean_batch_size"] = self.mean_batch_size
        return out


class Batcher(Generic[K, R]):
    """Collects awaited requests and evaluates them in batches (see the module docstring).

    Args:
        evaluate: ``evaluate(keys) -> results``, one result (or exception instance) per key,
            in order; a plain function (run on ``executor``) or an ``async def``.
        max_batch_size: a batch runs as soon as this many distinct keys are queued, and
            never holds more.
        timeout: seconds after the first queued request before its batch runs at the latest.
        flush: ``"idle"`` also runs a batch as soon as the event loop has no other ready
            work; ``"timer"`` waits for ``timeout`` or a full batch only.
        executor: where a plain ``evaluate`` runs. Defaults to a private one-thread executor.
            Batchers that share one engine should share one single-thread executor.
            ``INLINE`` runs it on the event loop's thread (it may return the results or an
            ``asyncio.Future`` of them).
        copy_result: makes the private copy handed to every extra awaiter of one result.
        name: names the worker thread and appears in errors.

    Raises:
        ValueError: for a non-positive ``max_batch_size``, negative ``timeout`` or an
            unknown ``flush``.
    """

    def __init__(
        self,
        evaluate: Evaluate,
        *,
        max_batch_size: int = 20,
        timeout: float = 0.02,
        flush: str = "idle",
        executor: concurrent.futures.Executor | str | None = None,
        copy_result: Callable[[Any], Any] = private_copy,
        name: str = "batcher",
    ):
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if not timeout >= 0:
            raise ValueError(f"timeout must be >= 0 seconds, got {timeout!r}")
        if flush not in ("idle", "timer"):
            raise ValueError(f"flush must be 'idle' or 'timer', got {flush!r}")
        self.evaluate = evaluate
        self.is_async = inspect.iscoroutinefunction(evaluate)
        self.max_batch_size = max_batch_size
        self.timeout = float(timeout)
        self.flush = flush
        self.copy_result = copy_result
        self.name = name
        self.stats = BatcherStats()
        self.runs_inline = executor == INLINE
        self._executor = None if self.runs_inline else executor
        self._owns_executor = executor is None
        # One queue per event loop; queues of closed loops are failed and dropped as soon
        # as a new loop shows up.
        self._queues: dict[asyncio.AbstractEventLoop, LoopQueue] = {}
        self._lock = threading.Lock()
        self.is_closed = False

    @property
    def executor(self) -> concurrent.futures.Executor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"genlm-{self.name}"
                )
            return self._executor

    async def submit(self, key: K) -> R:
        """Queues ``key`` and returns its result once its batch has run.

        Raises:
            ClosedError: the batcher was closed, before or while the request waited, or the
                evaluation of its batch was cancelled (its executor was shut down).
            RequestDroppedError: ``reset()`` dropped the request before it ran.
            EngineError: ``evaluate`` raised for this request's batch, or returned something
                other than one result per key.
        """
        if self.is_closed:
            raise ClosedError(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        queue = self._queues.get(loop) or self._queue_for(loop)
        fut = queue.add(key)
        try:
            return await fut
        except asyncio.CancelledError:
            queue.forget(key, fut)
            raise

    def enqueue(self, key: K) -> asyncio.Future:
        """Queues ``key`` and returns the future of its result, on the running event loop.

        :meth:`submit` without its coroutine (for callers that await the future in their
        own): the same guarantees, except that a cancelled future leaves the queue lazily,
        when its batch is taken (it is still never evaluated unless someone else awaits it).

        Raises:
            ClosedError: the batcher was closed.
        """
        if self.is_closed:
            raise ClosedError(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        return (self._queues.get(loop) or self._queue_for(loop)).add(key)

    def _queue_for(self, loop: asyncio.AbstractEventLoop) -> LoopQueue:
        queue = self._queues.get(loop)
        if queue is None:
            self._fail_closed_loops()
            queue = self._queues[loop] = LoopQueue(self, loop)
        return queue

    def _fail_closed_loops(self) -> None:
        for loop, queue in list(self._queues.items()):
            if loop.is_closed():
                queue.fail_everything(lambda: ClosedError("the event loop was closed"))
                del self._queues[loop]

    def reset(self) -> None:
        """Fails every queued (not yet running) waiter with ``RequestDroppedError``.

        Requests already handed to ``evaluate`` still get their results. Safe to call from
        the thread that runs the event loop; waiters of other loops are failed through
        their own loop.
        """
        self._for_each_queue(lambda q: q.drop_pending(_dropped))

    def close(self) -> None:
        """Fails every queued and running waiter with ``ClosedError``; later submits raise.

        Idempotent. Shuts down the private executor without waiting for a batch in flight.
        """
        if self.is_closed:
            return
        self.is_closed = True
        self._for_each_queue(
            lambda q: q.fail_everything(lambda: ClosedError(f"{self.name} was closed"))
        )
        self._queues.clear()
        if self._owns_executor and isinstance(self._executor, concurrent.futures.Executor):
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _for_each_queue(self, action: Callable[[LoopQueue], None]) -> None:
        for loop, queue in list(self._queues.items()):
            if loop.is_closed() or _loop_in_this_thread(loop):
                action(queue)
            else:
                done = threading.Event()

                def run(queue=queue, done=done):
                    try:
                        action(queue)
                    finally:
                        done.set()

                try:
                    loop.call_soon_threadsafe(run)
                except RuntimeError:  # closed in the meantime
                    action(queue)
                    continue
                done.wait(timeout=5.0)


def _loop_in_this_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return not loop.is_running()


def _dropped() -> RequestDroppedError:
    return RequestDroppedError("the request was dropped by reset_async_queries() before it ran")
