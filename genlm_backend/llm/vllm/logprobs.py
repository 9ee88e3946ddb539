"""How the vLLM engine (:class:`.vllm_engine.VLLMEngine`) runs a log-probability batch on
its thread: match the requests to sessions, make their engine jobs, run them, settle the
sessions; the holds between steps; and the rows vLLM lists where no capture processor runs
(speculative decoding)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..prompts import LogprobsRequest
from . import internals
from .runner import EngineJob, RowBatch
from .session_pool import PlanEntry, Session, SessionPool

__all__ = ["Continued", "LogprobsMixin", "listing_refusal"]


class LogprobsMixin:
    """The log-probability steps of :class:`.vllm_engine.VLLMEngine` (its ``llm``, sink,
    sessions, adapters, runner and thread are set up by its constructor)."""

    def _start_batch(self, requests: list[LogprobsRequest], batch: RowBatch) -> None:
        """On the engine thread: matches ``requests`` to sessions, then runs them next.

        Requests that continue held sessions get no job: their rows come from the sessions'
        next step (see :mod:`.session_pool`)."""
        try:
            requests = self.lora.with_adapters(requests, batch)
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
        self.thread.submit_next(self._run_batch, requests, plan, jobs, continued, batch)

    def _logprob_job(
        self, request: LogprobsRequest, entry: PlanEntry | None, batch: RowBatch, i: int
    ) -> EngineJob:
        """A plain request (``entry`` None) or a chunk of ``entry``'s session."""
        sink = self._sink
        lora_request = self.lora.request(request.lora_name)
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

    def _on_retry(self, jobs: list[EngineJob]) -> None:
        """Before jobs run again as plain requests (after an out-of-memory error): their
        sessions are gone; their rows go to the jobs themselves."""
        for job in jobs:
            session = None if job.stream_id is None else self._sessions.get(job.stream_id)
            if session is not None:
                self._sessions.close(session)
            if job.tag is not None and self._sink.final_in_step:
                self._sink.expect(job.tag, job.finish)

    def _on_step(self, tags: list[int]) -> dict[int, int]:
        """Inside an engine step, after its rows went out: holds the step for the next batch's
        plan while the held sessions wait for it; returns the tokens to force."""
        if not self._sessions.holds:
            return {}
        if self._runner.can_hold():  # the batch's rows go to the loop now
            self._sessions.decided = False
            self.thread.hold(lambda: self._sessions.decided, self.session_hold_s)
        return self._sessions.release()

    def _park(self, session: Any) -> None:
        request, llm = session.engine_request, self.llm
        if llm is None:
            return
        if request is None or not internals.park(llm.llm_engine, request.request_id):
            self._sessions.close(session)

    def _install_listing(self, engine: Any) -> str | None:
        """Takes the listed rows from this engine's step outputs; returns why it cannot, or None."""
        from .capture import CAPTURE_KEY  # imports vllm

        refusal = listing_refusal(self._model_config.max_logprobs, self.vocab_size)
        if refusal is not None:
            return refusal
        if not internals.install_listed_rows(engine, CAPTURE_KEY, self._receive_listed):
            return ("this vLLM's output processor differs from the checked versions "
                    f"{internals.CHECKED_VERSIONS}: full-vocabulary log-probabilities need "
                    "the capture logits processor here")
        return None

    def _receive_listed(self, mark: Any, token_ids: Any, logprobs: Any) -> None:
        """A row vLLM listed (token ids and their log-probabilities) for one of our requests."""
        token, tag = mark
        if token == self._sink.token:
            row = torch.full((self.vocab_size,), float("-inf"), dtype=torch.float32)
            row[torch.from_numpy(token_ids).long()] = torch.from_numpy(logprobs).float()
            self._sink.receive(tag, row)


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
