"""The capture of full-vocabulary rows inside vLLM's engine step, and the forcing of tokens.

Relies on vLLM's custom logits-processor interface, ``vllm.v1.sample.logits_processor``
(checked against the versions in :data:`~genlm_backend.llm.vllm.internals.CHECKED_VERSIONS`; the
tests in ``tests/llm/test_vllm_internals.py`` fail loudly when it moves): a processor class passed
as ``LLM(logits_processors=[cls])`` is instantiated by the engine; ``update_state(BatchUpdate)``
reports rows removed, added (as ``(index, SamplingParams, prompt_token_ids,
output_token_ids)``, where ``output_token_ids`` is the request's live output list) and moved
(``(a, b, MoveDirectionality)``); ``apply(logits)`` sees the fp32 logits ``[num_rows, V]`` of
the persistent batch, before penalties and temperature. Processors that say they are *not*
argmax-invariant run on every step, greedy batches included (argmax-invariant ones are
skipped when every row is greedy). With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and one worker
(``tensor_parallel_size=1``) the processor lives in this process, so it can hand rows to a
process-wide registry of sinks. Where the engine's workers are other processes
(``tensor_parallel_size > 1``, ``distributed_executor_backend="mp"``), the processor of the
worker whose output the engine reads writes the rows of this process's sinks into a ring
both processes map (:class:`RemoteRows`, :mod:`genlm_backend.llm.row_ring`); that step's output says
where they are, and they reach their sinks (:func:`deliver_remote`) before the engine handles the
step's results.

How rows reach their requests: every capture request carries
``SamplingParams.extra_args[CAPTURE_KEY] = [sink_token, tag]``. The processor keeps a map
``row index -> (sink_token, tag)`` up to date from the batch updates (identity, not order)
and, on every step, gives each sink its tagged rows (:meth:`CaptureSink.capture`): the
log-softmax of every *final* row (not a partial prefill) goes to the target expected for
its tag, inside the step; the sink's ``on_step`` hook may then name tokens to force. Where
finality cannot be told (no :func:`~genlm_backend.llm.vllm.internals.discard_mask_reader`), a prompt
split over several engine steps writes partial rows first, the row of the step that finishes the
prompt comes last and wins, and once the request has an output token it is no longer
written. Rows of requests without a tag (plain sampling) cost one dictionary lookup per
step. A tag whose row never arrives is an error (:meth:`CaptureSink.take`), never a wrong
row.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from .forcing import current_forcing, force_tokens
from .internals import CHECKED_VERSIONS
from .internals.row_sinks import CAPTURE_KEY
from .internals.row_sinks import SINKS as _SINKS
from .internals.row_sinks import DeviceLists as _Staging

__all__ = [
    "CAPTURE_KEY", "CaptureSink", "LogprobsCaptureProcessor", "follow_batch", "set_decisions",
    "set_remote",
]

# In an engine worker process whose output the engine reads: where the rows of sinks that
# live in the engine's process go (see RemoteRows; None elsewhere).
_REMOTE: Any = None  # a remote_rows.RemoteRows
# In an engine worker process: the tokens to force in the step being sampled (see set_decisions).
_DECISIONS: dict[str, dict[int, int]] | None = None
_NONE: dict[int, int] = {}


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

    def __init__(
        self,
        *,
        discarded: Callable[[int], Any] | None = None,
        remote_final: bool = False,
        runner_final: bool = False,
        on_step: Callable[[list[int]], dict[int, int]] | None = None,
    ) -> None:
        self.token = uuid.uuid4().hex
        self._tags = itertools.count(1)
        self._rows: dict[int, torch.Tensor | None] = {}
        self._targets: dict[int, Callable[[torch.Tensor], None]] = {}
        self._followers: dict[int, Callable[[torch.Tensor], None]] = {}
        self._lock = threading.Lock()
        self.discarded = discarded  # the V1 runner's partial prefills (discard_mask_reader)
        self.remote_final = remote_final  # rows from a worker process that tells finality
        self.runner_final = runner_final  # the sampler of Model Runner V2 tells final rows
        self.on_step = on_step
        _SINKS[self.token] = self

    @property
    def final_in_step(self) -> bool:
        """Rows reach their targets inside the step that computes them, known to be final
        (else a tag's row is stored, and the last one written wins)."""
        return self.discarded is not None or self.remote_final or self.runner_final

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
            RuntimeError: the row never arrived (the engine core runs in another process, or
                vLLM changed how it reports batch rows or step outputs).
        """
        with self._lock:
            row = self._rows.pop(tag, None)
        if row is None:
            raise RuntimeError(
                "the logits processor delivered no row for this request: the engine core runs in "
                "another process (use VLLM_ENABLE_V1_MULTIPROCESSING=0) or this vLLM differs from "
                f"the checked versions {CHECKED_VERSIONS}"
            )
        return row

    def receive(self, tag: int, row: torch.Tensor) -> None:
        """A final row of ``tag`` computed in another process (see :func:`deliver_remote`)."""
        target = self._followers.get(tag) or self._targets.pop(tag, None)
        if target is not None:
            target(row)
        else:
            self.put(tag, row)

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
        self,
        logits: torch.Tensor,
        rows: dict[int, tuple[str, int, list[int]]],
        mine_only: bool,
        staging: _Staging,
    ) -> list[tuple[int, int]]:
        """One step of the logits processor: ``rows`` maps a row index to ``(sink token, tag,
        output ids)`` (only this sink's rows unless ``mine_only``); returns the ``(index,
        token)`` pairs to force, sorted by index."""
        # Finality unknown (no mask): the last row written before the output wins.
        final = _final_rows(
            rows, self.discarded, logits.shape[0], self.token if mine_only else None
        )
        return self.hand_over(logits, final, staging)

    def hand_over(
        self, logits: torch.Tensor, final: list[tuple[int, int]], staging: _Staging
    ) -> list[tuple[int, int]]:
        """The rows' part of an engine step, inside it: ``final`` are the ``(row index, tag)``
        pairs of this sink's final rows of ``logits`` (sorted by index). Each expected row
        goes to its caller as an fp32 log-softmax; then, where sessions are held, the step
        waits for the next batch's plan (``on_step``). Returns the ``(index, token)`` pairs
        that plan forces, sorted by index."""
        followers, targets, slots = self._followers, self._targets, self._rows
        wanted = [
            (i, tag) for i, tag in final if tag in followers or tag in targets or tag in slots
        ]
        if wanted:
            # Outside inference mode: callers get ordinary tensors they may modify in place.
            with torch.inference_mode(False), torch.no_grad():
                picked = _rows_of(logits, [i for i, _ in wanted], staging)
                captured = torch.log_softmax(picked, dim=-1, dtype=torch.float32).unbind(0)  # views
            if not self.final_in_step:
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
        in_step = self.discarded is not None or self.runner_final  # (else rows come from a ring)
        if not in_step or self.on_step is None or not final:
            return []
        forced = self.on_step([tag for _, tag in final])
        if not forced:
            return []
        return [(i, forced_id) for i, tag in final if (forced_id := forced.get(tag)) is not None]


def follow_batch(rows: dict[int, Any], batch_update: BatchUpdate,
                 entry_of: Callable[[Any, list[int]], Any]) -> None:
    """Applies one of vLLM's batch updates to what a logits processor keeps per batch row
    (``rows``: batch row index -> entry): removed rows go, an added row gets
    ``entry_of(sampling_params, output_ids)`` (None: nothing kept for it), moved rows follow
    their requests (a swap exchanges two rows, a move leaves its source empty)."""
    for index in batch_update.removed:
        rows.pop(index, None)
    for index, params, _prompt_ids, output_ids in batch_update.added:
        entry = entry_of(params, output_ids)
        if entry is None:
            rows.pop(index, None)
        else:
            rows[index] = entry
    for a, b, direction in batch_update.moved:
        entry_a, entry_b = rows.pop(a, None), rows.pop(b, None)
        if entry_a is not None:
            rows[b] = entry_a
        if entry_b is not None and direction == MoveDirectionality.SWAP:
            rows[a] = entry_b


def _capture_entry(params: Any, output_ids: list[int]) -> tuple[str, int, list[int]] | None:
    """A captured request's row entry: (sink token, tag, its live output token list)."""
    capture = (getattr(params, "extra_args", None) or {}).get(CAPTURE_KEY)
    return None if capture is None else (capture[0], int(capture[1]), output_ids)


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
        follow_batch(self.rows, batch_update, _capture_entry)
        self._sinks = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = self.rows
        if not rows:
            return logits
        sinks = self._sink_tokens()
        forced: list[tuple[int, int]] = []
        for token in sinks:
            sink = _SINKS.get(token)
            if sink is not None:
                forced += sink.capture(logits, rows, len(sinks) > 1, self._staging)
            elif _REMOTE is not None and not _REMOTE.early:
                # a worker: the sink lives in the engine's process
                _REMOTE.capture(logits, rows, token, self._staging)
        # a worker: the tokens the engine's process decided for this step
        if _DECISIONS is not None:
            forced += [(i, t) for i, (sink, tag, _) in rows.items()
                       if (t := _DECISIONS.get(sink, _NONE).get(tag)) is not None]
            forced.sort()
        elif len(sinks) > 1 and forced:
            forced.sort()
        if forced:
            forcing = current_forcing()
            if forcing is not None:  # the sampler's own call forces them (or skips sampling)
                forcing.pending = forced
            else:
                force_tokens(logits, forced)
        return logits

    def gather_remote(self, logits: torch.Tensor, remote: Any) -> None:
        """In a worker, before the step samples: gives ``remote`` the rows of the sinks
        that live in the engine's process."""
        if self.rows:
            for token in self._sink_tokens():
                if token not in _SINKS:
                    remote.capture(logits, self.rows, token, self._staging)

    def _sink_tokens(self) -> set[str]:
        if self._sinks is None:
            self._sinks = {sink for sink, _, _ in self.rows.values()}
        return self._sinks


def set_remote(remote: Any) -> None:
    """Makes this process's capture processors gather other processes' rows in ``remote``."""
    global _REMOTE
    _REMOTE = remote


def set_decisions(decisions: dict[str, dict[int, int]] | None) -> None:
    """In a worker: the tokens to force in the step being sampled (``{sink token: {tag:
    token}}``, decided in the engine's process), or None."""
    global _DECISIONS
    _DECISIONS = decisions


def _final_rows(rows: dict[int, tuple[str, int, list[int]]], discarded: Callable[[int], Any] | None,
                num_rows: int, sink_token: str | None) -> list[tuple[int, int]]:
    """The ``(index, tag)`` pairs of this step's final rows (of ``sink_token``'s requests
    only, unless None), sorted by index: rows that are no partial prefill by the runner's
    mask (``discarded``), or, without a mask, rows whose request has no output token yet."""
    if discarded is None:
        final = [(i, tag) for i, (sink, tag, out) in rows.items()
                 if not out and (sink_token is None or sink == sink_token)]
    else:
        partial = discarded(num_rows).tolist()
        final = [(i, tag) for i, (sink, tag, _) in rows.items()
                 if not partial[i] and (sink_token is None or sink == sink_token)]
    final.sort()
    return final


def _rows_of(logits: torch.Tensor, rows: list[int], staging: _Staging) -> torch.Tensor:
    """``logits[rows]`` (``rows`` sorted): a view when they are contiguous, ``logits`` itself
    when they are all of it."""
    if rows[-1] - rows[0] + 1 == len(rows):
        if len(rows) == logits.shape[0]:
            return logits
        return logits[rows[0] : rows[-1] + 1]
    return logits.index_select(0, staging.put(rows))
