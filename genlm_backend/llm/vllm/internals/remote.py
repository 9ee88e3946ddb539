"""Rows from engine workers in other processes: the worker gathers them into a
:class:`~genlm_backend.llm.row_ring.RowRing`, its reply says where they are, and they
reach this process's sinks inside the step that computed them, so sessions are held between
steps as in an in-process engine (see :mod:`genlm_backend.llm.vllm.internals`).

A step of vLLM's engine core is two calls to the workers: ``execute_model`` (the forward
pass; the logits wait in the runner's ``execute_model_state``) and ``sample_tokens``. Where
the engine core runs one step at a time (``max_concurrent_batches == 1``), the worker whose
reply the engine reads gathers the step's final rows at the end of ``execute_model`` and
replies with :class:`EarlyRows` in place of None; this process hands the rows over and asks
for the tokens to force (``on_rows``) before it calls ``sample_tokens``, which carries them
to every worker (:class:`Forced`): each rank forces the same tokens, as the ranks of a
tensor-parallel group must sample alike. With a batch queue (async scheduling, pipeline
parallelism) the engine core does not read ``execute_model``'s reply, so rows go with the
step's sampled output instead and are handed over before the scheduler handles it (no holds).
"""

from __future__ import annotations

import copy
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from .engine_core import _model_runner, _scheduler
from .held_requests import _install_forced, _install_generator_rewind, _mask_reader
from .installed import installed_on

__all__ = ["RING_BYTES", "EarlyRows", "Forced", "RemoteCapture", "install_remote_capture"]

# The attribute of a worker's step output that carries the captured rows to this process.
_ROWS_ATTR = "genlm_capture_rows"
# A worker's row ring holds at most this many bytes (rows beyond it travel as arrays).
RING_BYTES = 2**30


@dataclasses.dataclass(frozen=True)
class RemoteCapture:
    """How captured rows come from an engine whose model runner is another process."""

    ring: Any  # this process's map of the worker's RowRing, or None (rows come as arrays)
    final_rows: bool  # the worker tells partial prefills (rows are final when they arrive)
    early: bool  # rows arrive before the step samples (forced tokens can be sent back)


@dataclasses.dataclass(slots=True)
class EarlyRows:
    """A worker's reply to ``execute_model``: the step's rows, gathered before sampling."""

    parts: list


@dataclasses.dataclass(slots=True)
class Forced:
    """``sample_tokens``'s argument with the tokens every rank forces this step
    (``{sink token: {tag: token id}}``)."""

    grammar_output: Any
    decisions: dict


def install_remote_capture(llm: Any, parts: Any) -> RemoteCapture | None:
    """Brings the captured rows of an engine whose workers run in other processes.

    The worker whose output the engine reads (``executor.output_rank``; the others capture
    nothing) gathers the rows of this process's sinks into a ring both processes map, and
    says where they are; they are handed over on the engine thread, which gets the tokens to
    force after them (``{sink token: {tag: token}}``, or None). ``parts`` (pickled to the
    workers, so made of module-level names:
    :class:`~genlm_backend.llm.vllm.remote_rows.RemoteParts`) does what is not vLLM's:
    ``deliver(rows, ring)`` hands rows over and returns those tokens; ``open_ring(handle)``,
    ``create_ring(max_rows, depth, width, device, lag)`` and ``read_lag`` are the ring's;
    in a worker, ``forcing()`` makes a forced sampling (:func:`install_forced_sampling`),
    ``set_decisions(tokens)`` says the tokens to force this step, ``new_rows(discarded,
    ring, early)`` makes the gatherer, ``set_remote(gatherer)`` gives it to the capture
    processors and ``gather(processors, logits, gatherer)`` gathers a step's rows before
    sampling. Returns None where the model runner is in this process (nothing to do) or where
    this cannot be arranged (the engine core in another process, a worker without these
    calls): log-probability calls then fail with a clear error.
    """
    engine = llm.llm_engine
    scheduler = _scheduler(engine)
    core = getattr(engine.engine_core, "engine_core", None)
    executor = getattr(core, "model_executor", None)
    if _model_runner(engine) is not None or scheduler is None or executor is None:
        return None
    if installed_on(scheduler).get("remote_capture") is not None:
        return installed_on(scheduler)["remote_capture"]
    config = engine.vllm_config
    width = int(engine.model_config.get_vocab_size())
    early = _one_step_at_a_time(core) and all(callable(getattr(executor, n, None))
                                              for n in ("execute_model", "sample_tokens"))
    # Rows read before their step samples wait for no later step (see row_ring).
    batches = int(getattr(config, "max_concurrent_batches", 2))
    depth, lag = (0, 0) if early else (max(batches - 1, 1), parts.read_lag)
    max_rows = min(
        int(config.scheduler_config.max_num_seqs), RING_BYTES // ((depth + lag + 2) * width * 4)
    )
    installed = llm.collective_rpc(_install_in_worker, args=(
        parts, getattr(executor, "output_rank", 0), max_rows, depth, lag, width, early))
    found = next((i for i in installed if isinstance(i, dict)), None)
    if found is None:
        return None
    ring = None
    if found["ring"] is not None:
        try:
            ring = parts.open_ring(found["ring"])
            ring.lag = lag
        except (RuntimeError, OSError):  # the worker is on another host: rows travel as arrays
            llm.collective_rpc(_drop_ring)
    remote = RemoteCapture(ring, found["final_rows"], early)
    if early:
        _hand_over_before_sampling(executor, lambda rows: parts.deliver(rows, remote.ring))
    else:
        _before_update(scheduler,
                       lambda _scheduled, output: _deliver_rows(output, parts.deliver, remote.ring))
    installed_on(scheduler)["remote_capture"] = remote
    return remote


def _one_step_at_a_time(core: Any) -> bool:
    """The engine core runs ``step`` (one step at a time), not ``step_with_batch_queue``,
    which never reads ``execute_model``'s reply when sampling succeeds."""
    return getattr(core, "batch_queue", True) is None


def _hand_over_before_sampling(executor: Any, on_rows: Callable[[list], dict | None]) -> None:
    """Wraps the executor's two calls of a step: a reply of :class:`EarlyRows` to
    ``execute_model`` goes to ``on_rows`` (on the engine thread, which may hold the step
    there) and the engine core sees None; the tokens ``on_rows`` returns go to every worker
    with the step's ``sample_tokens``."""
    execute_model, sample_tokens = executor.execute_model, executor.sample_tokens
    decided: list = [None]

    def reply(output: Any) -> Any:
        if type(output) is not EarlyRows:
            return output
        decided[0] = on_rows(output.parts) or None
        return None

    def execute(scheduler_output: Any, non_block: bool = False) -> Any:
        decided[0] = None
        output = execute_model(scheduler_output, non_block=non_block)
        return _Reply(output, reply) if non_block else reply(output)

    def sample(grammar_output: Any, non_block: bool = False) -> Any:
        decisions, decided[0] = decided[0], None
        if decisions is not None:
            grammar_output = Forced(grammar_output, decisions)
        return sample_tokens(grammar_output, non_block=non_block)

    executor.execute_model, executor.sample_tokens = execute, sample


class _Reply:
    """A future of ``execute_model``'s reply whose result goes through ``reply`` once."""

    def __init__(self, future: Any, reply: Callable[[Any], Any]):
        self._future, self._reply = future, reply

    def result(self, timeout: float | None = None) -> Any:
        reply, self._reply = self._reply, None
        output = self._future.result() if timeout is None else self._future.result(timeout)
        return output if reply is None else reply(output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._future, name)


def _deliver_rows(output: Any, on_rows: Callable[[Any, Any], Any], ring: Any) -> None:
    rows = getattr(output, _ROWS_ATTR, None)
    if rows is not None:
        on_rows(rows, ring)


def _before_update(scheduler: Any, hook: Callable[[Any, Any], None]) -> None:
    """Runs ``hook(scheduler_output, model_runner_output)`` on every step output before the
    scheduler's ``update_from_output`` handles it (one wrapper a scheduler; hooks run in the
    order they were installed)."""
    hooks = installed_on(scheduler).get("before_update")
    if hooks is None:
        hooks = []
        original = scheduler.update_from_output

        def update_from_output(scheduler_output: Any, model_runner_output: Any) -> Any:
            for run in hooks:
                run(scheduler_output, model_runner_output)
            return original(scheduler_output, model_runner_output)

        scheduler.update_from_output = update_from_output
        installed_on(scheduler)["before_update"] = hooks  # (hooks that do not refer to it)
    hooks.append(hook)


def _install_in_worker(worker: Any, parts: Any, output_rank: int, max_rows: int, depth: int,
                       lag: int, width: int, early: bool) -> dict | bool:
    """In a worker process (through ``collective_rpc``): every rank forces the tokens that
    come with ``sample_tokens``; the output rank also gathers rows for the engine's process,
    into a row ring it shares, and replies with them (``early``: to ``execute_model``, else
    with the step's output). Returns the ring's handle and whether the rank tells partial
    prefills (False on the other ranks, and where the rows cannot be gathered as asked)."""
    runner = getattr(worker, "model_runner", None)
    _install_generator_rewind(runner)  # every rank samples
    sample_tokens = getattr(worker, "sample_tokens", None)
    if sample_tokens is None or getattr(runner, "sample_tokens", None) is None:
        return False
    if early and not (hasattr(runner, "execute_model_state")
                      and callable(getattr(worker, "execute_model", None))):
        return False  # (its ring would be sized for rows read at once)
    if not installed_on(worker).get("forced"):
        _install_forced(runner, parts.forcing())

        def sample(grammar_output: Any) -> Any:
            if type(grammar_output) is not Forced:
                return sample_tokens(grammar_output)
            parts.set_decisions(grammar_output.decisions)
            try:
                return sample_tokens(grammar_output.grammar_output)
            finally:
                parts.set_decisions(None)

        worker.sample_tokens = sample
        installed_on(worker)["forced"] = True
    if getattr(worker, "rank", None) != output_rank:
        return False
    remote = _gatherer(runner)
    if remote is None:
        remote = _gather_in(worker, runner, parts, max_rows, depth, lag, width, early)
    ring = remote.ring
    return {
        "ring": None if ring is None else ring.handle(),
        "final_rows": remote.discarded is not None,
    }


def _drop_ring(worker: Any) -> None:
    """In a worker process: its rows go in its replies, not into a ring."""
    remote = _gatherer(getattr(worker, "model_runner", None))
    if remote is not None:
        remote.ring = None


def _gatherer(runner: Any) -> Any:
    """The gatherer of rows installed in this worker's ``runner``, if any."""
    found = installed_on(runner).get("gatherer") if runner is not None else None
    return None if found is None else found()


def _gather_in(worker: Any, runner: Any, parts: Any, max_rows: int, depth: int, lag: int,
               width: int, early: bool) -> Any:
    """Makes the output rank's capture processors gather the rows of the engine process's
    sinks, and its replies carry them."""
    device = getattr(runner, "device", "cpu")
    try:
        ring = parts.create_ring(max_rows, depth, width, device, lag) if max_rows > 0 else None
    except (RuntimeError, OSError):  # no room for it: rows travel as arrays
        ring = None
    remote = parts.new_rows(_mask_reader(runner), ring, early)
    if early:
        execute_model = worker.execute_model

        def execute(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            output = execute_model(scheduler_output, *args, **kwargs)
            state = runner.execute_model_state
            if output is not None or state is None:
                return output
            rows = parts.gather(runner.input_batch.logitsprocs.all, state.logits, remote)
            return None if rows is None else EarlyRows(rows)

        worker.execute_model = execute
    else:
        runner_sample = runner.sample_tokens

        def sample(*args: Any, **kwargs: Any) -> Any:
            output = runner_sample(*args, **kwargs)
            rows = remote.take()
            return output if rows is None else _carrying(output, rows)

        runner.sample_tokens = sample
    # (the gatherer's mask reader refers to the runner; the wrappers above hold it)
    installed_on(runner)["gatherer"] = weakref.ref(remote)
    parts.set_remote(remote)
    return remote


def _carrying(output: Any, rows: Any) -> Any:
    """``output`` (a step's ``ModelRunnerOutput``, or an async one) with ``rows`` attached."""
    get_output = getattr(output, "get_output", None)
    if callable(get_output):  # async scheduling: the output is made later, on the worker
        output.get_output = lambda: _carrying(get_output(), rows)
        return output
    output = copy.copy(output)  # never touch a shared one (vLLM's EMPTY_MODEL_RUNNER_OUTPUT)
    setattr(output, _ROWS_ATTR, rows)
    return output
