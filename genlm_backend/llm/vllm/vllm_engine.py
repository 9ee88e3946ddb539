"""The vLLM engine behind :class:`~genlm_backend.llm.vllm.AsyncVirtualLM`: exact
full-vocabulary log-probabilities and vLLM's own sampling, behind the engine protocol
(:mod:`genlm_backend.llm.engine`).

How a log-probability row is made: every distinct prompt of a batch becomes one engine
request (or a chunk of a live session, :mod:`.session_pool`) whose
``SamplingParams.extra_args`` carry a capture tag. A logits processor installed in the engine
(:mod:`.capture`) maps batch rows to tags from vLLM's batch updates and hands the fp32
log-softmax of each request's final row to its caller inside the engine step that computed
it, also when vLLM spreads the batch over several steps (chunked prefill, more prompts than
``max_num_seqs``). Sampling requests carry no tag and pay nothing for it. vLLM refuses logits
processors alongside speculative decoding: such an engine lists every token's log-probability
instead (``logprobs=-1``), and the rows are taken from the step's output on the CPU.

Lockstep sampling: once every row of a batch is out, the step waits (briefly; any other
engine work ends the wait) for the next batch. Requests that extend a session's context by
one token continue it: their token is forced as the session's next token, so the next step
is a plain decode step over the running requests, as in vLLM's own generation loop.

Engine work runs on the engine's single thread, the log-probability batches' and the
sampling batches' alike; the engine threads of all engines in the process take turns
(:data:`.runner.ENGINE_LOCK`), so engine calls never overlap.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import warnings
from typing import Any

import torch

from ...engine_thread import EngineThread
from ...exceptions import EngineError
from ..engine import stops_what_it_started
from ..prompts import LogprobsRequest
from . import internals
from .engine_sampling import EngineSampler
from .logprobs import LogprobSteps, listing_refusal
from .lora_requests import LoRARequests
from .runner import ENGINE_LOCK, EngineJob, EngineRunner, RowBatch
from .session_pool import SessionPool

__all__ = ["CLOSE_WAIT_S", "VLLMEngine"]

# The longest ``close`` waits for the engine thread to finish the step it is in.
CLOSE_WAIT_S = 60.0


class VLLMEngine:
    """Runs log-probability batches and sampling requests through one ``vllm.LLM``.

    Args (see :class:`~genlm_backend.llm.vllm.AsyncVirtualLM`, which builds it):
        llm: the ``vllm.LLM``, built with the capture logits processor where ``can_capture``.
        sample_batch_size, timeout, flush: of the sampling batcher.
        can_capture, session_idle_batches, session_hold_s: as for ``AsyncVirtualLM``.

    Attributes:
        max_num_seqs: the most sequences the engine runs in one step (vLLM's scheduler).
    """

    @stops_what_it_started
    def __init__(
        self,
        llm: Any,
        *,
        sample_batch_size: int,
        timeout: float,
        flush: str,
        can_capture: bool,
        session_idle_batches: int,
        session_hold_s: float,
    ):
        import vllm

        from . import capture, remote_rows
        from .forcing import ForcedSampling

        self.llm = llm
        internals.register_engine(llm)
        self._model_config = llm.llm_engine.model_config
        self.vocab_size = int(self._model_config.get_vocab_size())
        # vLLM needs room for the one token a log-probability request generates.
        self.max_prompt_len = int(self._model_config.max_model_len) - 1
        self.thread = EngineThread("genlm-AsyncVirtualLM", ENGINE_LOCK)
        engine = llm.llm_engine
        scheduler_config = engine.vllm_config.scheduler_config
        self.max_num_seqs = int(scheduler_config.max_num_seqs)
        async_scheduling = bool(getattr(scheduler_config, "async_scheduling", False))
        # Under async scheduling a parked session's next chunk never gave its row (CUDA,
        # vLLM 0.26): every request is a plain one there.
        self._sessions_usable = (can_capture and internals.supports_sessions(engine)
                                 and not async_scheduling)
        internals.install_chunk_max_tokens(engine)  # a resumed session is held again
        internals.install_parked_bypass(engine)  # parked sessions cost no scheduler time
        internals.install_cpu_generator_rewind(engine)  # seeded prompts split over steps
        # Rows go to their callers inside the step that computes them where the step tells
        # which rows are final: Model Runner V2's sampler, or the V1 runner's mask of partial
        # prefills; sessions are then held between steps (async scheduling off).
        self._row_sampler = internals.row_sampler(engine) if can_capture else None
        discarded = internals.discard_mask_reader(engine)
        # Workers in other processes (tensor parallelism, the "mp" executor) write their rows
        # into a ring this process maps, and the step waits here for the tokens to force.
        self._remote = (internals.install_remote_capture(llm, remote_rows.RemoteParts())
                        if can_capture and self._row_sampler is None else None)
        remote_final = self._remote is not None and self._remote.final_rows
        self._holds = (
            can_capture
            and (discarded is not None or self._row_sampler is not None
                 or (remote_final and self._remote.early))
            and not async_scheduling
        )
        self._sink = capture.CaptureSink(
            discarded=discarded, remote_final=remote_final,
            runner_final=self._row_sampler is not None,
            on_step=self._on_step if self._holds else None,
        )
        # Without the capture processor (speculative decoding), vLLM lists every token's
        # log-probability and the rows are taken from the step's output.
        self._listing_refusal = None if can_capture else self._install_listing(engine)
        # A step whose every row is a held session continued by the next batch takes the
        # forced tokens as its sample, without vLLM's sampler (ForcedSampling).
        self._forcing = self._row_sampler or (
            internals.install_forced_sampling(engine, ForcedSampling()) if self._holds else None)
        # Steps of held sessions alone, each taking its forced token, skip vLLM's general
        # scheduling and outputs: steady steps (not where rows are read at the update).
        self._steady = internals.install_steady_steps(engine) if self._holds else None
        self.session_hold_s = float(session_hold_s)
        # Log-probability requests take one greedy token (without the capture processor they
        # ask vLLM to list every token's log-probability); a held session runs until parked
        # (and stops by itself at max_model_len).
        self._plain_params = vllm.SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, logprobs=None if can_capture else -1,
            **internals.NO_DEEP_COPY,
        )
        self._held_params = vllm.SamplingParams(
            max_tokens=self._model_config.max_model_len, ignore_eos=True, temperature=0.0,
            detokenize=False, **internals.NO_DEEP_COPY,
        )
        self._sessions = SessionPool(
            self._abort, 0, session_idle_batches, park=self._park if self._holds else None,
            follow=self._sink.follow if self._holds else None, unfollow=self._sink.unfollow,
        )
        self.lora = LoRARequests(llm, self.thread, self._sessions)
        self._runner = EngineRunner(
            llm,
            default_convert=self._take_row,
            check_lora=self.lora.check,  # jobs whose adapter was removed meanwhile fail
            on_retry=self._on_retry,
            between_steps=self.thread.pass_turn,
            free_parked=self._sessions.free_parked,
        )
        self._steps = LogprobSteps(
            sessions=self._sessions, sink=self._sink, lora=self.lora, runner=self._runner,
            thread=self.thread, holds=self._holds, plain_params=self._plain_params,
            held_params=self._held_params,
        )
        # A sampling batch is one engine call that vLLM schedules continuously: capping it at
        # the log-probability batch size would run the chunks of one batch one after another.
        self.sampler = EngineSampler(self._runner, self.thread, self.lora, sample_batch_size,
                                     timeout, flush)

    # ---- the engine protocol --------------------------------------------------------------

    def evaluate(self, requests: list[LogprobsRequest]) -> Any:
        """On the event loop: hands the batch to the engine thread; returns a future of its rows."""
        if self._listing_refusal is not None:
            return [EngineError(self._listing_refusal) for _ in requests]
        batch = RowBatch(asyncio.get_running_loop(), len(requests), deferred=self._holds)
        # Hold-safe: if the engine is holding the step of the previous batch's rows, the plan
        # runs inside it and decides which sessions continue.
        self.thread.submit_hold_safe(self._steps.start_batch, requests, batch)
        return batch.future

    async def sample(self, request: LogprobsRequest, max_tokens: int,
                     eos_token_ids: frozenset[int], temperature: float, seed: int | None,
                     options: dict[str, Any]) -> Any:
        return await self.sampler.sample(request, max_tokens, eos_token_ids, temperature, seed,
                                         options)

    def load_adapter(self, name: str, path: str, adapter_id: int) -> None:
        self.lora.load(name, path, adapter_id)

    def unload_adapter(self, name: str) -> None:
        self.lora.unload(name)

    def close(self) -> None:
        """Fails the sampling callers; the run in flight stops after its step (its callers
        get ``ClosedError``), queued engine work is cancelled, and the engine thread shuts the
        engine down as its last task. Waits for that (at most :data:`CLOSE_WAIT_S`)."""
        self.sampler.batcher.close()
        self._runner.close()
        done = self.thread.shutdown(wait=False, cancel_futures=True, last=self._shutdown)
        if done is None or self.thread.on_thread:
            return
        try:
            done.result(timeout=CLOSE_WAIT_S)
        except concurrent.futures.TimeoutError:
            warnings.warn(
                f"cleanup: the engine thread is still busy after {CLOSE_WAIT_S} s; the engine "
                "is shut down on it once its work is done", RuntimeWarning, stacklevel=4,
            )

    # ---- what AsyncVirtualLM offers besides ---------------------------------------------

    def set_sessions(self, sessions: bool | int) -> None:
        """Session capacity: True, up to ``max_num_seqs``; an int, at most that many."""
        if not isinstance(sessions, int):
            raise TypeError(f"sessions must be True, False or an int, got {sessions!r}")
        capacity = self.max_num_seqs
        if sessions is not True:
            capacity = min(int(sessions), capacity)
        capacity = max(capacity, 0) if self._sessions_usable else 0
        self.thread.submit(self._sessions.resize, capacity).result()

    def close_sessions(self) -> int:
        """Closes every live session (waits for the engine thread); returns how many."""
        return self.thread.submit(self._sessions.close_all).result()

    def warm_up(self, requests: list[LogprobsRequest]) -> None:
        """Runs ``requests`` once so vLLM caches their KV (blocks)."""
        import vllm

        jobs = [
            EngineJob(r.token_ids, vllm.SamplingParams(max_tokens=1, detokenize=False),
                      lambda o: None, self.lora.request(r.lora_name))
            for r in requests
        ]
        for result in self.thread.submit(self._runner.run, jobs).result():
            if isinstance(result, BaseException):
                raise result

    def model_module(self) -> torch.nn.Module:
        """The torch module the engine runs, where it is in this process."""
        return internals.model_module(self.llm)

    def stats(self) -> dict[str, Any]:
        """The sampling batcher's, the engine's and the sessions' counters."""
        forcing, steady = self._forcing, self._steady
        return {
            "sample": self.sampler.batcher.stats.as_dict(),
            "engine": {**self._runner.stats.as_dict(),
                       "model_runner": "v1" if self._row_sampler is None else "v2",
                       "num_forced_steps": 0 if forcing is None else forcing.num_skipped,
                       "num_steady_steps": 0 if steady is None else steady.num_steady},
            "sessions": self._sessions.stats(),
        }

    # ---- inside -------------------------------------------------------------------------

    def _take_row(self, job: EngineJob, output: Any) -> Any:
        """A log-probability job's row, where it is taken when its request finishes."""
        return self._sink.take(job.tag)

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

    def _abort(self, request_ids: list[str]) -> None:
        self._runner.abort(request_ids)

    def _stop_started(self) -> None:
        """After a failed construction (of this engine or of its model): stops the parts it
        started; the ``vllm.LLM`` is left running (it is the caller's)."""
        sampler, sink = getattr(self, "sampler", None), getattr(self, "_sink", None)
        if sampler is not None:
            sampler.batcher.close()
        if sink is not None:
            sink.close()
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.shutdown(wait=True, cancel_futures=True)

    def _shutdown(self) -> None:
        """The engine thread's last task: shuts the engine down."""
        llm, self._runner.llm, self.llm = self._runner.llm, None, None
        self._sink.close()
        if self._remote is not None and self._remote.ring is not None:
            self._remote.ring.release()  # before its worker exits
        internals.shutdown(llm)
