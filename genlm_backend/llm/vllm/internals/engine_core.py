"""The engine itself: where its model runner and scheduler are, plain requests, aborts,
stall detection, engine-start preferences and shutdown (checked against
:data:`CHECKED_VERSIONS`; see :mod:`genlm_backend.llm.vllm.internals`)."""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from vllm import TokensPrompt
from vllm.sampling_params import RequestOutputKind

try:  # 0.32: a prompt already in the engine's form; raw prompts are deprecated there
    from vllm.inputs.engine import tokens_input as _tokens_input
except ImportError:  # 0.26: the engine takes the raw token prompt
    _tokens_input = None

__all__ = [
    "CHECKED_VERSIONS",
    "NO_DEEP_COPY",
    "abort_requests",
    "add_request",
    "cpu_aot_reload_fails",
    "envs_cache_enabled",
    "is_cuda_oom",
    "is_stalled",
    "model_module",
    "off_envs_cache",
    "output_done",
    "prefer_spawned_workers",
    "prefer_v1_model_runner",
    "refill_envs_cache",
    "register_engine",
    "shutdown",
    "token_prompt",
]

CHECKED_VERSIONS = ("0.26.0", "0.32.0")


def _no_deep_copy() -> dict[str, bool]:
    """``SamplingParams(skip_clone=True)`` where this vLLM has it (0.32: the engine deep-copies
    every request's params otherwise; ours are built fresh for each request)."""
    import vllm

    fields = getattr(vllm.SamplingParams, "__struct_fields__", ())
    return {"skip_clone": True} if "skip_clone" in fields else {}


NO_DEEP_COPY = _no_deep_copy()


def _model_runner(engine: Any) -> Any:
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    driver = getattr(getattr(core, "model_executor", None), "driver_worker", None)
    worker = getattr(driver, "worker", None)
    return getattr(worker, "model_runner", None)


def _scheduler(engine: Any) -> Any:
    return getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)


def model_module(llm: Any) -> torch.nn.Module:
    """The torch module that ``llm`` (a ``vllm.LLM``) runs, where it lives in this process:
    its model runner's model (0.26 and 0.32: ``model_runner.get_model()``).

    Raises:
        RuntimeError: the engine core runs in another process (vLLM's multiprocessing
            engine core), or the model does in worker processes (``tensor_parallel_size > 1``,
            ``distributed_executor_backend="mp"``), or the structure moved.
    """
    engine = llm.llm_engine
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    if core is None:
        raise RuntimeError(
            "the model is not in this process: vLLM runs its engine core in another process "
            "(VLLM_ENABLE_V1_MULTIPROCESSING=0 keeps it in this one)"
        )
    executor = getattr(core, "model_executor", None)
    if executor is not None and getattr(executor, "driver_worker", None) is None:
        raise RuntimeError(
            f"the model is not in this process: its workers are other processes "
            f"({type(executor).__name__}); reach them with llm.collective_rpc"
        )
    runner = _model_runner(engine)
    module = runner.get_model() if runner is not None and hasattr(runner, "get_model") else None
    if not isinstance(module, torch.nn.Module):
        # the engine's structure moved, not a wrong type passed in: the documented RuntimeError
        raise RuntimeError(  # noqa: TRY004
            "the model runner's torch module was not found where vLLM 0.26/0.32 keep it "
            "(engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model())"
        )
    return module


def is_cuda_oom(exc: BaseException) -> bool:
    """True for a device out-of-memory error, also when vLLM wrapped it."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def token_prompt(token_ids: tuple[int, ...]) -> Any:
    """``token_ids`` as this vLLM's engine takes a prompt: its engine input (0.32), which the
    engine uses as it is, else a ``TokensPrompt``."""
    if _tokens_input is not None:
        return _tokens_input(list(token_ids))
    return TokensPrompt(prompt_token_ids=list(token_ids))


def add_request(
    engine: Any, request_id: str, prompt: tuple[int, ...], params: Any, lora_request: Any
) -> None:
    """Adds one token prompt to ``LLM.llm_engine`` (``LLMEngine.add_request``).

    ``LLM.generate`` returns only when every request is done; stepping the engine ourselves
    (as ``LLM`` does inside) lets each result go to its caller as soon as it finishes. The
    outputs carry ``request_id`` as given here (0.32 adds a random suffix internally only).
    """
    params.output_kind = RequestOutputKind.FINAL_ONLY
    engine.add_request(
        request_id, token_prompt(prompt), params, lora_request=lora_request
    )


def output_done(output: Any) -> bool:
    """True when ``output`` ends its request, or ends a session chunk (``finished`` stays False)."""
    return bool(output.finished) or any(c.finish_reason is not None for c in output.outputs)


def is_stalled(engine: Any) -> bool:
    """True when the scheduler has waiting requests but runs none (e.g. every slot is held
    by a parked session); False when that cannot be told."""
    scheduler = _scheduler(engine)
    if scheduler is None:
        return False
    running, waiting = scheduler.get_request_counts()
    return running == 0 and waiting > 0


def free_slots(engine: Any) -> int | None:
    """Requests the scheduler could still admit: ``max_num_seqs`` less the running requests
    and the waiting ones (parked sessions wait, and hold a slot); None where the scheduler
    is not in this process."""
    scheduler = _scheduler(engine)
    if scheduler is None:
        return None
    running, waiting = scheduler.get_request_counts()
    return int(scheduler.scheduler_config.max_num_seqs) - running - waiting


def abort_requests(engine: Any, request_ids: list[str]) -> None:
    """Aborts requests by the ids given to :func:`add_request`."""
    try:
        engine.abort_request(request_ids, internal=False)
    except TypeError:  # versions without the ``internal`` flag
        engine.abort_request(request_ids)


def prefer_v1_model_runner() -> bool:
    """Asks vLLM for its V1 model runner (the one the capture processor, holds and forced
    sampling work with) by ``VLLM_USE_V2_MODEL_RUNNER=0``, unless the caller chose a runner;
    returns whether this set it. vLLM reads the variable when an engine is configured (and
    caches it after the first engine of a process has started)."""
    if "VLLM_USE_V2_MODEL_RUNNER" in os.environ:
        return False
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return True


def prefer_spawned_workers(engine_opts: dict) -> bool:
    """Asks vLLM to start worker processes by ``spawn`` (``VLLM_WORKER_MULTIPROC_METHOD``)
    when ``engine_opts`` give the engine workers in other processes, unless the caller
    chose a method; returns whether this set it. vLLM forks by default and switches to
    spawn only when it sees CUDA initialized; a forked worker of a process that touched
    CUDA another way fails ("Cannot re-initialize CUDA in forked subprocess", seen on the
    H100 under pytest with 0.26). Spawned workers import the caller's main module again,
    as with any spawned process: scripts keep their work under ``if __name__ == "__main__"``."""
    multi = any(
        int(engine_opts.get(key) or 1) > 1
        for key in ("tensor_parallel_size", "pipeline_parallel_size")
    )
    if not (multi or engine_opts.get("distributed_executor_backend") == "mp"):
        return False
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ:
        return False
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return True


def envs_cache_enabled() -> bool:
    """Whether ``vllm.envs`` answers from its cache rather than ``os.environ``. The engine core
    fills it as it starts (``enable_envs_cache()`` in ``EngineCore.__init__``, 0.32; the last
    engine's shutdown empties it, ``disable_envs_cache()``): a variable changed afterwards is
    not seen until the cache is emptied. 0.32 caches by wrapping the module's ``__getattr__``
    in ``functools.cache``; other versions keep a ``_env_cache`` dict."""
    from vllm import envs

    return (
        hasattr(getattr(envs, "__getattr__", None), "cache_clear")
        or getattr(envs, "_env_cache", None) is not None
    )


def off_envs_cache() -> None:
    """Empties ``vllm.envs``'s cache and leaves it off (``disable_envs_cache``): variables are
    read from ``os.environ`` again."""
    from vllm import envs

    envs.disable_envs_cache()


def refill_envs_cache() -> None:
    """Empties ``vllm.envs``'s cache and turns it on again (``disable_envs_cache``, then
    ``enable_envs_cache``): it fills from ``os.environ`` as variables are read."""
    from vllm import envs

    envs.disable_envs_cache()
    envs.enable_envs_cache()


def cpu_aot_reload_fails() -> bool:
    """Whether vLLM would AOT-compile a CPU engine's model into an artefact that the next start
    cannot load: AOT compile on (``vllm.envs.VLLM_USE_AOT_COMPILE``, vLLM's default with torch
    2.10 or newer, read from the caller's environment) and a loader that finalises what it
    loads as vLLM's own compiled function (``VllmSerializableFunction.finalize_loading``,
    0.32), which the CPU platform's plain Inductor compile does not produce."""
    from vllm import envs

    try:
        from vllm.compilation.caching import VllmSerializableFunction
    except ImportError:  # a vLLM without that loader
        return False
    loader_finalises = hasattr(VllmSerializableFunction, "finalize_loading")
    return bool(envs.VLLM_USE_AOT_COMPILE) and loader_finalises


_LIVE_ENGINES: set[int] = set()
_SHUTDOWN_LOCK = threading.Lock()


def register_engine(llm: Any) -> None:
    """Counts ``llm`` among the in-process engines that share vLLM's process-wide state."""
    _LIVE_ENGINES.add(id(llm))


def shutdown(llm: Any) -> None:
    """Stops the engine core of ``llm``; keeps process-wide state while other engines live.

    ``EngineCore.shutdown`` (0.32) ends with ``cleanup_dist_env_and_memory()``, which
    destroys the process-wide model-parallel groups that every in-process engine uses:
    shutting one engine down would break the others ("pipeline model parallel group is not
    initialized"). While another registered engine is live, that call is replaced by a
    garbage collection for the duration of this shutdown; the last engine tears down all.
    """
    _LIVE_ENGINES.discard(id(llm))
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is None or not hasattr(engine_core, "shutdown"):
        return
    with _SHUTDOWN_LOCK:
        if not _LIVE_ENGINES:
            engine_core.shutdown()
            return
        import gc

        from vllm.v1.engine import core as core_module

        original = core_module.cleanup_dist_env_and_memory
        core_module.cleanup_dist_env_and_memory = gc.collect
        try:
            engine_core.shutdown()
        finally:
            core_module.cleanup_dist_env_and_memory = original
