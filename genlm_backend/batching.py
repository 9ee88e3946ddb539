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
      of that key get it; if ``evaluate`` raises, each awaiter of that batch gets its own
      :class:`~genlm_backend.exceptions.EngineError` and the next batch runs as usual;
    * cancelling one awaiter removes only its own wait; a key nobody waits for any more is
      dropped from the queue before it reaches the engine.

One batch runs at a time per event loop. A plain function ``evaluate`` runs on a worker
thread (``executor``; pass the same executor to batchers that share one engine so their
calls never overlap), so the event loop stays responsive while the engine works; with
``executor=INLINE`` it runs on the event loop's own thread instead, which saves the thread
hand-off (about 0.1-0.2 ms a batch here) but blocks the loop while the engine works; an
``async def`` evaluate is awaited on the loop. State is kept per event loop, so the batcher
keeps working when ``asyncio.run`` is called repeatedly or a notebook changes loops; waiters
of a loop that was closed under them are failed, never left pending.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from .exceptions import ClosedError, EngineError, RequestDroppedError

__all__ = ["Batcher", "BatcherStats", "INLINE", "private_copy"]

INLINE = "inline"
"""Pass as ``executor`` to run a plain ``evaluate`` on the event loop's thread."""

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")

Evaluate = Callable[[list], "Sequence[Any] | Awaitable[Sequence[Any]]"]

# Idle probes of every batcher, so that two batchers waiting for an idle loop do not keep
# each other "busy" forever.
_IDLE_PROBES: set[asyncio.Handle] = set()


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
        num_failed_batches: calls of ``evaluate`` that raised.
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


@dataclass(eq=False)
class _Entry:
    """One distinct key and the futures of everyone who awaits it."""

    key: Any
    queued_at: float
    waiters: list[asyncio.Future] = field(default_factory=list)


class _LoopQueue:
    """The queue of one batcher on one event loop: take a batch, run it, resolve it."""

    def __init__(self, batcher: Batcher, loop: asyncio.AbstractEventLoop):
        self.batcher = batcher
        self.loop = loop
        self.pending: dict[Any, _Entry] = {}
        self.running: dict[Any, _Entry] = {}
        self.is_busy = False
        self.timer: asyncio.TimerHandle | None = None
        self.idle_probe: asyncio.Handle | None = None
        self.start_soon: asyncio.Handle | None = None
        self.num_added = 0
        self.num_added_at_last_probe = -1

    # ---- queueing -------------------------------------------------------------------

    def add(self, key: Any) -> asyncio.Future:
        fut = self.loop.create_future()
        stats = self.batcher.stats
        stats.num_requests += 1
        self.num_added += 1
        if key in self.running:
            self.running[key].waiters.append(fut)
            stats.num_joined += 1
            return fut
        if key in self.pending:
            self.pending[key].waiters.append(fut)
            stats.num_deduplicated += 1
            return fut
        self.pending[key] = _Entry(key, time.perf_counter(), [fut])
        self.schedule()
        return fut

    def forget(self, key: Any, fut: asyncio.Future) -> None:
        """Drops one cancelled waiter; a pending key nobody awaits any more is dropped."""
        for table in (self.pending, self.running):
            entry = table.get(key)
            if entry is not None and fut in entry.waiters:
                entry.waiters.remove(fut)
                if not entry.waiters and table is self.pending:
                    del table[key]
                return

    def drop_pending(self, error_factory: Callable[[], BaseException]) -> None:
        entries, self.pending = list(self.pending.values()), {}
        self.cancel_triggers()
        for entry in entries:
            _fail_all(entry.waiters, error_factory)

    def fail_everything(self, error_factory: Callable[[], BaseException]) -> None:
        running, self.running = list(self.running.values()), {}
        self.drop_pending(error_factory)
        for entry in running:
            _fail_all(entry.waiters, error_factory)

    # ---- deciding when to run -------------------------------------------------------

    def schedule(self) -> None:
        if self.is_busy or not self.pending:
            return
        batcher = self.batcher
        if len(self.pending) >= batcher.max_batch_size:
            if self.start_soon is None:
                self.start_soon = self.loop.call_soon(self.start)
            return
        if self.timer is None:
            first = min(e.queued_at for e in self.pending.values())
            delay = max(0.0, first + batcher.timeout - time.perf_counter())
            self.timer = self.loop.call_later(delay, self.start)
        if batcher.flush == "idle" and self.idle_probe is None:
            self._probe_soon()

    def _probe_soon(self) -> None:
        self.idle_probe = self.loop.call_soon(self._probe_idle)
        _IDLE_PROBES.add(self.idle_probe)

    def _probe_idle(self) -> None:
        _IDLE_PROBES.discard(self.idle_probe)
        self.idle_probe = None
        if self.is_busy or not self.pending:
            return
        if self._loop_has_other_ready_work():
            self._probe_soon()
        else:
            self.start()

    def _loop_has_other_ready_work(self) -> bool:
        ready = getattr(self.loop, "_ready", None)
        if ready is not None:  # CPython's event loops: look at the ready queue itself
            return any(handle not in _IDLE_PROBES for handle in ready)
        # Other loops (uvloop): call the loop idle once a full pass added no request.
        is_quiet = self.num_added == self.num_added_at_last_probe
        self.num_added_at_last_probe = self.num_added
        return not is_quiet

    def cancel_triggers(self) -> None:
        for handle in (self.timer, self.idle_probe, self.start_soon):
            if handle is not None:
                handle.cancel()
                _IDLE_PROBES.discard(handle)
        self.timer = self.idle_probe = self.start_soon = None

    # ---- running a batch ------------------------------------------------------------

    def start(self) -> None:
        """Takes up to ``max_batch_size`` pending keys and hands them to ``evaluate``."""
        self.cancel_triggers()
        if self.is_busy or not self.pending:
            return
        batcher = self.batcher
        keys = list(self.pending)[: batcher.max_batch_size]
        batch = [self.pending.pop(k) for k in keys]
        now = time.perf_counter()
        for entry in batch:
            self.running[entry.key] = entry
            batcher.stats.queue_wait_s += now - entry.queued_at
        self.is_busy = True
        batcher.stats.num_batches += 1
        batcher.stats.num_evaluated += len(batch)
        if batcher.runs_inline:
            try:
                results, seconds = _timed_sync(batcher.evaluate, keys)
            except Exception as exc:  # noqa: BLE001 - routed to the batch's awaiters
                self.finish(batch, None, exc, 0.0)
            else:
                self.finish(batch, results, None, seconds)
            return
        try:
            if batcher.is_async:
                task = self.loop.create_task(_timed_async(batcher.evaluate, keys))
                task.add_done_callback(lambda t: self._on_async_done(batch, t))
            else:
                job = batcher.executor.submit(_timed_sync, batcher.evaluate, keys)
                job.add_done_callback(lambda j: self._on_thread_done(batch, j))
        except RuntimeError as exc:  # the executor was shut down under us
            self.finish(batch, None, ClosedError(f"{batcher.name} cannot run: {exc}"), 0.0)

    def _on_async_done(self, batch: list[_Entry], task: asyncio.Task) -> None:
        if task.cancelled():
            self.finish(batch, None, ClosedError("the event loop was shut down"), 0.0)
            return
        exc = task.exception()
        results, seconds = task.result() if exc is None else (None, 0.0)
        self.finish(batch, results, exc, seconds)

    def _on_thread_done(self, batch: list[_Entry], job: concurrent.futures.Future) -> None:
        exc = job.exception()
        results, seconds = job.result() if exc is None else (None, 0.0)
        try:
            self.loop.call_soon_threadsafe(self.finish, batch, results, exc, seconds)
        except RuntimeError:  # the loop was closed while the engine worked
            self.finish(batch, None, ClosedError("the event loop was closed"), seconds)

    def finish(
        self,
        batch: list[_Entry],
        results: Sequence[Any] | None,
        error: BaseException | None,
        seconds: float,
    ) -> None:
        """Resolves every waiter of ``batch``, then lets the next batch run."""
        stats = self.batcher.stats
        stats.evaluate_s += seconds
        if error is None and (results is None or len(results) != len(batch)):
            got = "None" if results is None else len(results)
            error = RuntimeError(f"evaluate returned {got} results for {len(batch)} keys")
        if error is not None:
            stats.num_failed_batches += 1
        for i, entry in enumerate(batch):
            if self.running.get(entry.key) is entry:
                del self.running[entry.key]
            if error is not None:
                _fail_all(entry.waiters, lambda: _engine_error(error, len(batch)))
            else:
                _resolve_all(entry.waiters, results[i], self.batcher.copy_result)
        self.is_busy = False
        if not self.loop.is_closed():
            self.schedule()


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
            ``INLINE`` runs it on the event loop's thread.
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
        self._queues: dict[asyncio.AbstractEventLoop, _LoopQueue] = {}
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
            ClosedError: the batcher was closed, before or while the request waited.
            RequestDroppedError: ``reset()`` dropped the request before it ran.
            EngineError: ``evaluate`` raised for this request's batch.
        """
        if self.is_closed:
            raise ClosedError(f"{self.name} is closed")
        queue = self._queue_for(asyncio.get_running_loop())
        fut = queue.add(key)
        try:
            return await fut
        except asyncio.CancelledError:
            queue.forget(key, fut)
            raise

    def _queue_for(self, loop: asyncio.AbstractEventLoop) -> _LoopQueue:
        queue = self._queues.get(loop)
        if queue is None:
            self._fail_closed_loops()
            queue = self._queues[loop] = _LoopQueue(self, loop)
        return queue

    def _fail_closed_loops(self) -> None:
        for loop, queue in list(self._queues.items()):
            if loop.is_closed():
                queue.fail_everything(lambda: ClosedError("the event loop was closed"))
                del self._queues[loop]

    @property
    def num_pending(self) -> int:
        """Distinct keys queued and not yet running, over every live event loop."""
        return sum(len(q.pending) for q in self._queues.values())

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
        self._for_each_queue(lambda q: q.fail_everything(lambda: ClosedError(f"{self.name} was closed")))
        self._queues.clear()
        if self._owns_executor and isinstance(self._executor, concurrent.futures.Executor):
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _for_each_queue(self, action: Callable[[_LoopQueue], None]) -> None:
        for loop, queue in list(self._queues.items()):
            if loop.is_closed() or _loop_in_this_thread(loop):
                action(queue)
            else:
                done = threading.Event()

                def run(queue=queue):
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


def _timed_sync(evaluate: Callable, keys: list) -> tuple[Sequence[Any], float]:
    start = time.perf_counter()
    results = evaluate(keys)
    return results, time.perf_counter() - start


async def _timed_async(evaluate: Callable, keys: list) -> tuple[Sequence[Any], float]:
    start = time.perf_counter()
    results = await evaluate(keys)
    return results, time.perf_counter() - start


def _dropped() -> RequestDroppedError:
    return RequestDroppedError("the request was dropped by reset_async_queries() before it ran")


def _engine_error(error: BaseException, batch_size: int) -> BaseException:
    if isinstance(error, ClosedError):
        return ClosedError(str(error))
    exc = EngineError(f"the engine failed on a batch of {batch_size} requests: {error!r}")
    exc.__cause__ = error
    return exc


def _fail_all(waiters: list[asyncio.Future], error_factory: Callable[[], BaseException]) -> None:
    for fut in waiters:
        if not fut.done():
            try:
                fut.set_exception(error_factory())
            except RuntimeError:  # its loop is closed: the future is marked done all the same
                pass


def _resolve_all(waiters: list[asyncio.Future], result: Any, copy_result: Callable) -> None:
    live = [fut for fut in waiters if not fut.done()]
    for i, fut in enumerate(live):
        if isinstance(result, BaseException):
            error = result if i == 0 else _copy_exception(result)
            _fail_all([fut], lambda: error)
            continue
        try:
            value = result if i == 0 else copy_result(result)
        except Exception as exc:  # noqa: BLE001 - the copy failed: fail this waiter only
            _fail_all([fut], functools.partial(_same, exc))
            continue
        try:
            fut.set_result(value)
        except RuntimeError:  # its loop is closed: the future is marked done all the same
            pass


def _same(value: Any) -> Any:
    return value


def _copy_exception(exc: BaseException) -> BaseException:
    twin = copy.copy(exc)
    twin.__cause__ = exc.__cause__
    return twin
