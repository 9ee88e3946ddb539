"""Rows from engine workers in other processes: the worker gathers them into a
:class:`~genlm_backend.llm.vllm.row_ring.RowRing`, its step output says where they are, and
they are handed over before the scheduler handles that output
(see :mod:`genlm_backend.llm.vllm.internals`)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

from .engine import _model_runner, _scheduler
from .sessions import _install_generator_rewind, _mask_reader

__all__ = ["RING_BYTES", "RemoteCapture", "install_remote_capture"]

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
    nothing) gathers the rows of this process's sinks (:class:`~genlm_backend.llm.vllm.capture.RemoteRows`)
    into a :class:`~genlm_backend.llm.vllm.row_ring.RowRing` both processes map, and its step output says where
    they are; this process's scheduler gets ``deliver(parts, ring)`` before it handles that
    output. Returns None where the model
    runner is in this process (nothing to do) or where this cannot be arranged (the engine
    core in another process, a worker without these calls): log-probability calls then
    fail with a clear error.
    """
    from ..row_ring import READ_LAG, open_ring

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
    from .. import capture
    from ..row_ring import RowRing

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
        remote = capture.RemoteRows(_mask_reader(runner), ring)

        def sample(*args: Any, **kwargs: Any) -> Any:
            output = sample_tokens(*args, **kwargs)
            rows = remote.take()
            return output if rows is None else _carrying(output, rows)

        runner.sample_tokens = sample
        runner._genlm_remote = remote
        capture.set_remote(remote)
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
