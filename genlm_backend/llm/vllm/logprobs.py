"""How the vLLM engine (:class:`.vllm_engine.VLLMEngine`) runs a log-probability batch on
its thread: match the requests to sessions, make their engine jobs, run them, settle the
sessions."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...engine_thread import EngineThread
from ..prompts import LogprobsRequest
from .lora_requests import LoRARequests
from .runner import EngineJob, EngineRunner, RowBatch
from .session_pool import PlanEntry, Session, SessionPool

__all__ = ["Continued", "LogprobSteps", "listing_refusal"]


class LogprobSteps:
    """How :class:`.vllm_engine.VLLMEngine` runs one log-probability batch on its thread.

    Args:
        sessions: the engine's session pool.
        sink: its capture sink (:class:`.capture.CaptureSink`).
        lora: its adapters (:class:`.lora_requests.LoRARequests`).
        runner: its runner.
        thread: its engine thread.
        holds: sessions are held between steps (their chunks take ``held_params``).
        plain_params, held_params: the ``SamplingParams`` of a plain request and of a
            held session's chunk, copied for each job.
    """

    def __init__(self, *, sessions: SessionPool, sink: Any, lora: LoRARequests,
                 runner: EngineRunner, thread: EngineThread, holds: bool, plain_params: Any,
                 held_params: Any):
        self._sessions, self._sink, self._lora = sessions, sink, lora
        self._runner, self._thread, self._holds = runner, thread, holds
        self._plain_params, self._held_params = plain_params, held_params

    def start_batch(self, requests: list[LogprobsRequest], batch: RowBatch) -> None:
        """On the engine thread: matches ``requests`` to sessions, then runs them next.

        Requests that continue held sessions get no job: their rows come from the sessions'
        next step (see :mod:`.session_pool`)."""
        try:
            requests = self._lora.with_adapters(requests, batch)
            plan = self._sessions.plan(requests, batch)
            jobs = [
                None if r is None or type(entry) is Session
                else self._logprob_job(r, entry, batch, i)
                for i, (r, entry) in enumerate(zip(requests, plan))
            ]
            continued = Continued.of(
                self._sessions, requests, plan, batch,
                lambda request, i: self._logprob_job(request, None, batch, i),
            )
        except BaseException as exc:  # noqa: BLE001 - fails this batch only
            batch.fail(exc)
            return
        self._thread.submit_next(self._run_batch, requests, plan, jobs, continued, batch)

    def _logprob_job(
        self, request: LogprobsRequest, entry: PlanEntry | None, batch: RowBatch, i: int
    ) -> EngineJob:
        """A plain request (``entry`` None) or a chunk of ``entry``'s session."""
        sink = self._sink
        lora_request = self._lora.request(request.lora_name)
        tag = sink.next_tag() if sink.final_in_step else sink.new_tag()
        base = self._held_params if entry is not None and self._holds else self._plain_params
        params = copy.copy(base)
        params.extra_args = sink.extra_args(tag)
        if entry is None:
            job = EngineJob(request.token_ids, params, None, lora_request, None,
                            request.token_ids, None, tag, batch, i)
        else:
            session = entry.session
            job = EngineJob(entry.tokens, params, None, lora_request, session.request_id,
                            request.token_ids, session.engine_request, tag, batch, i,
                            family=id(base))
            self._sessions.bind(entry, job, tag)
        if sink.final_in_step and (entry is None or not self._holds):
            sink.expect(tag, job.finish)  # held sessions take their rows themselves
        return job

    def _run_batch(self, requests: list[LogprobsRequest], plan: list, jobs: list, continued: Any,
                   batch: RowBatch) -> None:
        try:
            self._runner.run([job for job in jobs if job is not None], batch, continued)
        except BaseException as exc:  # noqa: BLE001 - fails the requests of this batch left
            batch.fail(exc, wake=False)
        finally:
            # Sessions settled before the callers hear: one told of a failure finds them closed.
            try:
                self._sessions.settle(requests, plan, jobs, batch.results)
                for job in jobs:
                    if job is not None and not isinstance(job.result, torch.Tensor):
                        self._sink.discard(job.tag)
            finally:
                batch.wake()


def listing_refusal(max_logprobs: int, vocab_size: int) -> str | None:
    """Why an engine that allows ``max_logprobs`` cannot list all ``vocab_size`` tokens'
    log-probabilities, or None if it can (-1: the whole vocabulary)."""
    if max_logprobs == -1 or max_logprobs >= vocab_size:
        return None
    return (f"full-vocabulary log-probabilities without the capture logits processor (speculative "
            f"decoding) need vLLM to list all {vocab_size} tokens, but this engine allows "
            f"max_logprobs={max_logprobs}: start it with max_logprobs=-1 (from_name does)")


class Continued:
    """The continuations of one batch, as the runner sees them: no engine request of their
    own (their rows come from their sessions' next step), until a failure turns the ones
    still waiting into plain requests (:meth:`take_jobs`)."""

    @classmethod
    def of(cls, pool: SessionPool, requests: Sequence[LogprobsRequest], plan: Sequence[Any],
           batch: Any, make_job: Callable[[LogprobsRequest, int], Any]) -> Continued | None:
        """The continuations of a planned batch (None if it has none)."""
        if not any(type(entry) is Session for entry in plan):
            return None
        return cls(pool, requests, plan, batch, make_job)

    def __init__(self, pool: SessionPool, requests: Sequence[LogprobsRequest],
                 plan: Sequence[Any], batch: Any, make_job: Callable[[LogprobsRequest, int], Any]):
        self._pool, self._requests, self._plan, self._batch = pool, requests, plan, batch
        self._make_job = make_job
        self._taken = False

    def _waiting(self) -> list[tuple[int, Session]]:
        if self._taken or self._batch.left == 0:
            return []
        return [
            (i, s) for i, s in enumerate(self._plan)
            if type(s) is Session and not self._batch.has(i)
        ]

    def any_waiting(self) -> bool:
        """Some continuation may still wait for its row: the batch is not complete (the
        runner asks while the batch's own jobs are done or not yet added)."""
        return not self._taken and self._batch.left > 0

    def stream_ids(self) -> list[str]:
        """The engine requests of the sessions whose row is still awaited (to abort)."""
        return [s.request_id for _, s in self._waiting()]

    def fail(self, make_error: Callable[[], BaseException]) -> None:
        """Closes the sessions still owing a row; their requests get ``make_error()``."""
        for i in self._close_waiting():
            self._batch.set(i, make_error())

    def take_jobs(self) -> list[Any]:
        """Closes the sessions still owing a row and returns plain jobs for their requests."""
        return [self._make_job(self._requests[i], i) for i in self._close_waiting()]

    def _close_waiting(self) -> list[int]:
        """Closes the sessions still owing a row (from now on the runner owns their
        requests); returns those requests' indices."""
        waiting = self._waiting()
        self._taken = True
        for _, session in waiting:
            self._pool.close(session)
        return [i for i, _ in waiting]
