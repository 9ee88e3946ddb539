"""Runs batches of requests through one ``vllm.LLM``: the step loop, early delivery, OOM splits.

Everything here runs on the model's engine thread (one call at a time). A batch is a list
of :class:`EngineJob`; each job turns its finished ``RequestOutput`` into its result, and
may hand that result to its caller at once (``deliver``) instead of at the end of the batch.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...engine_thread import TurnLock
from ...exceptions import ClosedError, EngineError, InvalidRequestError
from . import internals

__all__ = ["ENGINE_LOCK", "EngineJob", "EngineRunner", "RowBatch"]

# Held by whatever runs an in-process vLLM engine of this process (a step, a request added,
# an adapter loaded, a shutdown; the engine build of ``from_name``): vLLM keeps the state of
# the step being run in process-wide globals (its forward context), so two engines' calls
# must not overlap. Every AsyncVirtualLM's engine thread holds it while it runs a task, lets
# it go while a step holds for the next batch, and passes the turn between steps.
ENGINE_LOCK = TurnLock()

_PENDING = object()


@dataclass(eq=False, slots=True)
class EngineJob:
    """One engine request: a prompt, its sampling parameters, and what to make of the output.

    Compared and hashed by identity, so a batcher never merges two jobs.
    """

    prompt: tuple[int, ...]
    params: Any  # vllm.SamplingParams
    convert: Callable[[Any], Any] | None  # RequestOutput -> result (None: the runner's default)
    lora_request: Any = None
    # A session chunk: ``prompt`` is appended to the live streaming request ``stream_id``
    # (opened by the first chunk); ``full_prompt`` is the whole context, for a retry as a
    # plain request once the session is gone. ``stream_request`` is the engine request of
    # the session's last chunk (None for the first), replaced by this chunk's once added.
    stream_id: str | None = None
    full_prompt: tuple[int, ...] | None = None
    stream_request: Any = None
    tag: int | None = None  # capture tag (log-probability jobs)
    # Early delivery of the result: ``batch.set(index, result)`` (a RowBatch), else
    # ``deliver(result)``.
    batch: Any = None
    index: int = 0
    deliver: Callable[[Any], None] | None = None
    # Jobs of one family differ only in extra_args (new sessions share a template).
    family: Any = None
    result: Any = field(default=_PENDING, repr=False)

    def unstream(self) -> None:
        """Turns this session chunk into a plain request over the whole context."""
        if self.stream_id is not None and self.full_prompt is not None:
            self.prompt, self.stream_id, self.stream_request = self.full_prompt, None, None
            if self.tag is not None:  # a held session's parameters: a plain request stops at once
                self.params = copy.copy(self.params)
                self.params.max_tokens, self.params.ignore_eos = 1, False

    @property
    def is_done(self) -> bool:
        return self.result is not _PENDING

    def finish(self, result: Any) -> None:
        """Gives this job its result (once) and hands it over."""
        if self.result is not _PENDING:
            return
        self.result = result
        if self.batch is not None:
            self.batch.set(self.index, result)
        elif self.deliver is not None:
            self.deliver(result)


@dataclass
class EngineStats:
    num_engine_calls: int = 0
    num_steps: int = 0
    num_oom_splits: int = 0
    engine_s: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.__dict__)
        total = self.num_prompt_tokens
        out["prefix_cache_hit_rate"] = self.num_cached_prompt_tokens / total if total else 0.0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated()
        else:
            import resource

            out["peak_device_memory_bytes"] = None
            out["peak_host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return out


class EngineRunner:
    """Adds jobs to the engine and steps it until they finish.

    On a device out-of-memory error the unfinished jobs are aborted and retried in two
    halves, down to single jobs; a single job that still runs out of memory gets an
    :class:`~genlm_backend.exceptions.EngineError`. Any other engine error aborts the
    unfinished jobs and propagates (the batcher hands it to every awaiter of the batch).

    Args:
        llm: the ``vllm.LLM`` whose engine runs the jobs.
        default_convert: (job, RequestOutput) -> result, for jobs without a ``convert``.
        check_lora: (a job's LoRARequest) -> the error that fails the job instead of adding
            it (its adapter was removed since), or None.
        on_retry: called with the jobs retried as plain requests after an out-of-memory error.
        between_steps: called after every engine step (other engines' turn).
        free_parked: (jobs, limit) -> whether any went: closes parked sessions not in
            ``jobs``, least recently used first, at most ``limit`` (None: all); called when
            the scheduler stalls, and before jobs that add more requests than it has slots.
    """

    def __init__(
        self,
        llm: Any,
        *,
        default_convert: Callable[[EngineJob, Any], Any] = lambda job, output: output,
        check_lora: Callable[[Any], BaseException | None] = lambda lora_request: None,
        on_retry: Callable[[Sequence[EngineJob]], None] | None = None,
        between_steps: Callable[[], None] = lambda: None,
        free_parked: Callable[[Sequence[EngineJob], int | None], bool] | None = None,
    ):
        self.llm = llm
        self.stats = EngineStats()
        self._ids = itertools.count()
        self.free_parked = free_parked
        self.stall_timeout_s = 60.0
        self.default_convert = default_convert
        self.on_retry = on_retry
        self.check_lora = check_lora
        self.in_step = False
        self.between_steps = between_steps
        self.closed = False  # set by close(): the run in flight stops after its step
        self._deferred_aborts: list[str] = []
        self._batch: RowBatch | None = None
        self._session_templates: dict = {}  # (job family -> template; internals.open_session)

    def run(self, jobs: Sequence[EngineJob], batch: RowBatch | None = None,
            continued: Any = None) -> list[Any]:
        """Runs ``jobs``; returns one result or exception instance per job, in order.

        ``batch``: the log-probability batch the jobs deliver to; an engine step may then
        wait for the next batch once every request of it has its result (:meth:`can_hold`).
        ``continued``: the batch's continuations (:class:`.logprobs.Continued`),
        requests with no job that the engine's running requests answer: the engine is
        stepped until they have their rows too.
        """
        start = time.perf_counter()
        self.stats.num_engine_calls += 1
        self._batch = batch
        try:
            self._run_splitting([j for j in jobs if not j.is_done], continued)
        finally:
            self._batch = None
            self.stats.engine_s += time.perf_counter() - start
        return [job.result for job in jobs]

    def can_hold(self) -> bool:
        """Inside a step: True when a batch is being run and every request of it has its
        result, so waiting delays no request. Hands the results over (:meth:`RowBatch.wake`)."""
        batch = self._batch
        if batch is None or batch.left:
            return False
        batch.wake()
        return True

    def close(self) -> None:
        """From any thread: the run in flight stops after the step being run (its requests
        aborted, its callers failed with ``ClosedError``), and so does any later run."""
        self.closed = True

    def abort(self, request_ids: list[str]) -> None:
        """Aborts engine requests now, or right after the step being run."""
        if self.in_step:
            self._deferred_aborts += request_ids
        elif self.llm is not None:
            internals.abort_requests(self.llm.llm_engine, request_ids)

    def _flush_aborts(self, engine: Any) -> None:
        if self._deferred_aborts:
            ids, self._deferred_aborts = self._deferred_aborts, []
            internals.abort_requests(engine, ids)

    def _run_splitting(self, jobs: list[EngineJob], continued: Any = None) -> None:
        if not jobs and (continued is None or not continued.any_waiting()):
            return
        try:
            self._run_once(jobs, continued)
        except BaseException as exc:
            if not internals.is_cuda_oom(exc):
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            pending = [j for j in jobs if not j.is_done]
            if self.on_retry is not None:
                self.on_retry(pending)
            for job in pending:  # their sessions were aborted: retry as plain requests
                job.unstream()
            if continued is not None:
                pending += continued.take_jobs()
            if len(pending) <= 1:
                for job in pending:
                    error = EngineError(f"out of device memory even for a single request: {exc!r}")
                    error.__cause__ = exc
                    job.finish(error)
                return
            self.stats.num_oom_splits += 1
            half = len(pending) // 2
            self._run_splitting(pending[:half])
            self._run_splitting(pending[half:])

    def _run_once(self, jobs: list[EngineJob], continued: Any = None) -> None:
        if self.closed:
            raise ClosedError("the model was cleaned up before this request ran")
        engine = self.llm.llm_engine
        running: dict[str, EngineJob] = {}
        uncounted: set[str] = set()  # requests added here whose prompt is not in the stats yet
        try:
            self._flush_aborts(engine)
            self._make_room(engine, jobs)
            for job in jobs:
                refusal = None if job.lora_request is None else self.check_lora(job.lora_request)
                if refusal is not None:  # its adapter was removed since the job was made
                    job.finish(refusal)
                    continue
                request_id = job.stream_id or f"genlm-{next(self._ids)}"
                try:
                    if job.stream_id is None:
                        internals.add_request(
                            engine, request_id, job.prompt, job.params, job.lora_request
                        )
                    elif job.stream_request is None and job.family is not None:
                        job.stream_request = internals.open_session(
                            engine, self._session_templates, job.family,
                            request_id, job.prompt, job.params, job.lora_request,
                        )
                    else:
                        job.stream_request = internals.add_session_chunk(
                            engine, request_id, job.prompt, job.params, job.lora_request,
                            job.stream_request,
                        )
                except Exception as exc:  # noqa: BLE001 - vLLM refused this request only
                    job.finish(_invalid(exc))
                    continue
                running[request_id] = job
                uncounted.add(request_id)
            stalled_since = None
            while (
                running or (continued is not None and continued.any_waiting())
            ) and engine.has_unfinished_requests():
                if self.closed:
                    raise ClosedError("the model was cleaned up while this request ran")
                self.stats.num_steps += 1
                self.in_step = True
                try:
                    outputs = engine.step()
                finally:
                    self.in_step = False
                    self._flush_aborts(engine)
                stalled_since = self._check_stall(engine, jobs, outputs, stalled_since)
                for output in outputs:
                    if output.request_id in uncounted:
                        uncounted.discard(output.request_id)
                        self.stats.num_prompt_tokens += len(output.prompt_token_ids or ())
                        self.stats.num_cached_prompt_tokens += output.num_cached_tokens or 0
                    job = running.get(output.request_id)
                    if job is None or job.is_done or not internals.output_done(output):
                        continue
                    del running[output.request_id]
                    try:
                        result = (job.convert(output) if job.convert is not None
                                  else self.default_convert(job, output))
                    except Exception as exc:  # noqa: BLE001 - this job's own failure
                        result = exc
                    job.finish(result)
                # Log-probability rows arrive inside the step that computes them.
                running = {rid: job for rid, job in running.items() if not job.is_done}
                self.between_steps()
            for job in running.values():
                job.finish(EngineError("the engine finished without returning this request"))
            running.clear()
            if continued is not None:
                continued.fail(
                    lambda: EngineError("the engine finished without returning this request")
                )
        finally:
            ids = list(running) + (continued.stream_ids() if continued is not None else [])
            if ids:
                internals.abort_requests(engine, ids)

    def _make_room(self, engine: Any, jobs: Sequence[EngineJob]) -> None:
        """Closes parked sessions where ``jobs`` add more requests (plain ones, new sessions'
        first chunks) than the scheduler has free slots: a request that finds none waits
        for a running one to end, and parked sessions never end by themselves."""
        added = sum(1 for job in jobs if job.stream_request is None and not job.is_done)
        if not added or self.free_parked is None:
            return
        free = internals.free_slots(engine)
        if free is not None and added > free:
            self.free_parked(jobs, added - free)

    def _check_stall(self, engine: Any, jobs: Sequence[EngineJob], outputs: Any,
                     since: float | None) -> float | None:
        """Waiting requests and none running: parked sessions may hold every slot or block (or
        a grammar is still compiling). Frees parked sessions at once; a stall that outlives
        them by ``stall_timeout_s`` is an engine error instead of a hang."""
        if outputs or not internals.is_stalled(engine):
            return None
        now = time.perf_counter()
        if since is None:
            if self.free_parked is not None:
                self.free_parked(jobs, None)
            return now
        if now - since > self.stall_timeout_s:
            raise EngineError(f"the engine scheduled nothing for {self.stall_timeout_s} s: its "
                              "slots or KV blocks are held by requests it cannot finish")
        return since


class RowBatch:
    """The results of one log-probability batch, filled on the engine thread as rows arrive;
    :attr:`future` (of the event loop) resolves once every request has its result.

    With ``deferred``, the last result does not wake the event loop by itself: the engine
    thread calls :meth:`wake` once it is done with the step's bookkeeping (just before it
    waits), so the loop's work and the engine thread's do not take turns at the GIL.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int, deferred: bool = False):
        self.loop = loop
        self.future = loop.create_future()
        self.results: list[Any] = [_MISSING] * size
        self.left = size
        self.deferred = deferred
        self._woken = False

    def has(self, i: int) -> bool:
        return self.results[i] is not _MISSING

    def set(self, i: int, result: Any) -> None:
        if self.results[i] is not _MISSING:
            return
        self.results[i] = result
        self.left -= 1
        if self.left == 0 and not self.deferred:
            self.wake()

    def wake(self) -> None:
        """Hands the results to the event loop, once, if every request has its result."""
        if self.left or self._woken:
            return
        self._woken = True
        try:
            self.loop.call_soon_threadsafe(_resolve, self.future, self.results)
        except RuntimeError:  # the loop was closed: nobody waits any more
            pass

    def fail(self, exc: BaseException, wake: bool = True) -> None:
        """Every request still without a result gets an ``EngineError`` caused by ``exc``;
        ``wake=False`` leaves handing them over to a later :meth:`wake`."""
        for i, result in enumerate(self.results):
            if result is _MISSING:
                error = EngineError(f"the engine failed on this request's batch: {exc!r}")
                error.__cause__ = exc
                self.results[i] = error
                self.left -= 1
        if wake:
            self.wake()


_MISSING = object()


def _resolve(future: asyncio.Future, results: list[Any]) -> None:
    if not future.done():
        future.set_result(results)


def _invalid(exc: BaseException) -> InvalidRequestError:
    error = InvalidRequestError(f"vLLM refused the request: {exc}")
    error.__cause__ = exc
    return error
