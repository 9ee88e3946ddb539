"""The queue of one batcher on one event loop: take a batch, run it, resolve the futures.

Private to :mod:`genlm_backend.batching`, whose docstring states the guarantees. The
dependency goes one way: this module knows a batcher only as a :class:`BatchOwner`.

Every route by which a batch ends (a worker thread's job, a task, a loop future, or an
``evaluate`` that ran on the loop) ends in :meth:`LoopQueue.finish`, which never raises: a
bad result, a cancelled job or a failure while resolving fails that batch's awaiters, and
the next batch runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ._batch_results import batch_error, check_results, fail_all, outcome, resolve_all
from .exceptions import ClosedError

__all__ = ["BatchOwner", "LoopQueue", "call_when_idle"]


class BatchOwner(Protocol):
    """What a :class:`LoopQueue` reads from its batcher (``batching.Batcher``)."""

    evaluate: Callable[[list], Any]
    is_async: bool
    runs_inline: bool
    executor: concurrent.futures.Executor
    max_batch_size: int
    timeout: float
    flush: str
    copy_result: Callable[[Any], Any]
    name: str
    stats: Any  # a ``batching.BatcherStats``


# Callbacks that only wait for an idle loop. Ready ones are no work to a batcher's probe
# (two batchers waiting for an idle loop would otherwise keep each other busy forever); a
# ``call_when_idle`` probe counts the batchers' probes as work, so that its callback comes
# after the batches that start at that moment.
_FLUSH_PROBES: set[asyncio.Handle] = set()  # batchers' probes (each may start a batch)
_WAKE_PROBES: set[asyncio.Handle] = set()  # call_when_idle's probes


def _other_work_ready(
    loop: asyncio.AbstractEventLoop, flushes_are_work: bool = False
) -> bool | None:
    """Whether callbacks other than idle probes are ready to run on ``loop`` (with
    ``flushes_are_work``, other than ``call_when_idle``'s); None where the loop does not show
    its ready queue (CPython's loops do; uvloop does not)."""
    ready = getattr(loop, "_ready", None)
    if ready is None:
        return None
    if flushes_are_work:
        return any(handle not in _WAKE_PROBES for handle in ready)
    return any(handle not in _FLUSH_PROBES and handle not in _WAKE_PROBES for handle in ready)


def call_when_idle(
    loop: asyncio.AbstractEventLoop, callback: Callable[[], Any], max_wait: float
) -> None:
    """Calls ``callback()`` on ``loop`` (from its thread) once nothing else is ready to run
    there but idle probes, and after the batches that batchers start at that moment (and
    what their results make ready); or after ``max_wait`` seconds of a loop that never
    idles; on loops that do not show their ready queue, at the next turn."""
    deadline = loop.time() + max_wait

    def probe() -> None:
        _WAKE_PROBES.discard(probe.handle)
        if _other_work_ready(loop, flushes_are_work=True) and loop.time() < deadline:
            probe.handle = loop.call_soon(probe)
            _WAKE_PROBES.add(probe.handle)
        else:
            callback()

    probe.handle = loop.call_soon(probe)
    _WAKE_PROBES.add(probe.handle)


# One distinct key and the futures of everyone who awaits it: ``[queued_at, key, future,
# *more_futures]``. A plain list, one object per request: every object a request keeps alive
# while it waits is one more for the garbage collector to scan and promote.
_Entry = list
_WAITERS = 2  # where the futures start in an entry
_queued_at, _first_waiter = operator.itemgetter(0), operator.itemgetter(_WAITERS)
_is_done = operator.methodcaller("done")


class LoopQueue:
    """The queue of one batcher on one event loop: take a batch, run it, resolve it."""

    def __init__(self, batcher: BatchOwner, loop: asyncio.AbstractEventLoop):
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
        running = self.running
        if running:  # (empty while a lockstep sampler queues: no lookup, no hash call)
            entry = running.get(key)
            if entry is not None:
                entry.append(fut)
                stats.num_joined += 1
                return fut
        pending = self.pending
        entry = [time.perf_counter(), key, fut]
        known = pending.setdefault(key, entry)
        if known is not entry:
            known.append(fut)
            stats.num_deduplicated += 1
            return fut
        # A batch is already due (timer and idle probe set) unless this one fills it.
        if (
            self.timer is None
            or self.idle_probe is None
            or len(pending) >= self.batcher.max_batch_size
        ):
            self.schedule()
        return fut

    def forget(self, key: Any, fut: asyncio.Future) -> None:
        """Drops one cancelled waiter; a pending key nobody awaits any more is dropped."""
        for table in (self.pending, self.running):
            entry = table.get(key)
            if entry is not None and fut in entry[_WAITERS:]:
                del entry[entry.index(fut, _WAITERS)]  # (a key never compared with a future)
                if len(entry) == _WAITERS and table is self.pending:
                    del table[key]
                return

    def drop_pending(self, error_factory: Callable[[], BaseException]) -> None:
        entries, self.pending = list(self.pending.values()), {}
        self.cancel_triggers()
        for entry in entries:
            fail_all(entry[_WAITERS:], error_factory)

    def fail_everything(self, error_factory: Callable[[], BaseException]) -> None:
        running, self.running = list(self.running.values()), {}
        self.drop_pending(error_factory)
        for entry in running:
            fail_all(entry[_WAITERS:], error_factory)

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
            first = min(entry[0] for entry in self.pending.values())
            delay = max(0.0, first + batcher.timeout - time.perf_counter())
            self.timer = self.loop.call_later(delay, self.start)
        if batcher.flush == "idle" and self.idle_probe is None:
            self._probe_soon()

    def _probe_soon(self) -> None:
        self.idle_probe = self.loop.call_soon(self._probe_idle)
        _FLUSH_PROBES.add(self.idle_probe)

    def _probe_idle(self) -> None:
        _FLUSH_PROBES.discard(self.idle_probe)
        self.idle_probe = None
        if self.is_busy or not self.pending:
            return
        if self._loop_has_other_ready_work():
            self._probe_soon()
        else:
            self.start()

    def _loop_has_other_ready_work(self) -> bool:
        busy = _other_work_ready(self.loop)
        if busy is not None:  # CPython's event loops: the ready queue itself tells
            return busy
        # Other loops (uvloop): call the loop idle once a full pass added no request.
        is_quiet = self.num_added == self.num_added_at_last_probe
        self.num_added_at_last_probe = self.num_added
        return not is_quiet

    def cancel_triggers(self) -> None:
        for handle in (self.timer, self.idle_probe, self.start_soon):
            if handle is not None:
                handle.cancel()
                _FLUSH_PROBES.discard(handle)
        self.timer = self.idle_probe = self.start_soon = None

    # ---- running a batch ------------------------------------------------------------

    def start(self) -> None:
        """Takes up to ``max_batch_size`` pending keys and hands them to ``evaluate``."""
        self.cancel_triggers()
        if self.is_busy or not self.pending:
            return
        batcher = self.batcher
        taken = self.pending
        if len(taken) <= batcher.max_batch_size:  # all of it (the usual case)
            self.pending = {}
        else:
            taken = {k: taken.pop(k) for k in list(taken)[: batcher.max_batch_size]}
        # ``taken`` becomes the running table as it is (``running`` is empty between batches),
        # and the batch's lists come from it in C: no per-request Python here.
        batch = list(taken.values())
        if any(map(_is_done, map(_first_waiter, batch))):  # some awaiters cancelled
            for key, entry in list(taken.items()):
                if all(f.done() for f in entry[_WAITERS:]):  # ``Batcher.enqueue`` forgets lazily
                    del taken[key]
            batch = list(taken.values())
        if not batch:
            self.schedule()
            return
        keys = list(taken)
        self.running = taken
        wait = time.perf_counter() * len(batch) - sum(map(_queued_at, batch))
        stats = batcher.stats
        stats.queue_wait_s += wait
        self.is_busy = True
        stats.num_batches += 1
        stats.num_evaluated += len(batch)
        try:
            self._run(batch, keys)
        except BaseException as exc:
            # evaluate or the hand-off raised: this batch fails, the queue goes on
            self.finish(batch, None, exc, 0.0)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise

    def _run(self, batch: list[_Entry], keys: list) -> None:
        """Hands ``keys`` to ``evaluate`` by the batcher's route; each route ends in ``finish``."""
        batcher = self.batcher
        if batcher.runs_inline:
            start = time.perf_counter()
            results = batcher.evaluate(keys)
            if isinstance(results, asyncio.Future):  # computed elsewhere; resolved on this loop
                results.add_done_callback(lambda f: self._on_future_done(batch, f, start))
            else:
                self.finish(batch, results, None, time.perf_counter() - start)
        elif batcher.is_async:
            task = self.loop.create_task(_timed_async(batcher.evaluate, keys))
            task.add_done_callback(lambda t: self._on_timed_done(batch, t))
        else:
            try:
                job = batcher.executor.submit(_timed_sync, batcher.evaluate, keys)
            except RuntimeError as exc:  # the executor was shut down under us
                raise ClosedError(f"{batcher.name} cannot run: {exc}") from exc
            job.add_done_callback(lambda j: self._on_thread_done(batch, j))

    def _on_timed_done(self, batch: list[_Entry], task: asyncio.Task) -> None:
        timed, error = outcome(task)
        results, seconds = timed if error is None else (None, 0.0)
        self.finish(batch, results, error, seconds)

    def _on_future_done(self, batch: list[_Entry], future: asyncio.Future, start: float) -> None:
        results, error = outcome(future)
        self.finish(batch, results, error, time.perf_counter() - start)

    def _on_thread_done(self, batch: list[_Entry], job: concurrent.futures.Future) -> None:
        """Runs on the worker thread, or on whichever thread cancelled the job."""
        timed, error = outcome(job)
        results, seconds = timed if error is None else (None, 0.0)
        try:
            self.loop.call_soon_threadsafe(self.finish, batch, results, error, seconds)
        except RuntimeError:  # the loop was closed while the engine worked
            # Nobody can await its futures any more; a batch that evaluated is still no
            # failure (early-delivered samples end the loop before their batch ends).
            closed = None if error is None else ClosedError("the event loop was closed")
            self.finish(batch, results, closed, seconds)

    def finish(
        self,
        batch: list[_Entry],
        results: Sequence[Any] | None,
        error: BaseException | None,
        seconds: float,
    ) -> None:
        """Resolves every waiter of ``batch``, then lets the next batch run. Never raises: a
        result that cannot be delivered fails the waiters it did not reach."""
        stats = self.batcher.stats
        stats.evaluate_s += seconds
        # One batch runs at a time: what is running is this batch (or nothing, once failed).
        self.running = {}
        try:
            if error is None:
                error = check_results(results, len(batch))
            if error is None:
                try:
                    self._deliver(batch, results)
                except Exception as exc:  # noqa: BLE001 - a bad result: the rest of the batch fails
                    error = exc
            if error is not None:
                stats.num_failed_batches += 1
                for entry in batch:
                    fail_all(entry[_WAITERS:], functools.partial(batch_error, error, len(batch)))
        finally:
            self.is_busy = False
            if not self.loop.is_closed():
                self.schedule()

    def _deliver(self, batch: list[_Entry], results: Sequence[Any]) -> None:
        copy_result = self.batcher.copy_result
        for entry, result in zip(batch, results):
            if len(entry) == _WAITERS + 1 and not isinstance(result, BaseException):  # usual
                fut = entry[_WAITERS]
                if not fut.done():
                    try:
                        fut.set_result(result)
                    except RuntimeError:  # its loop is closed: the future is done all the same
                        pass
            else:
                resolve_all(entry[_WAITERS:], result, copy_result)


def _timed_sync(evaluate: Callable, keys: list) -> tuple[Sequence[Any], float]:
    start = time.perf_counter()
    results = evaluate(keys)
    return results, time.perf_counter() - start


async def _timed_async(evaluate: Callable, keys: list) -> tuple[Sequence[Any], float]:
    start = time.perf_counter()
    results = await evaluate(keys)
    return results, time.perf_counter() - start
