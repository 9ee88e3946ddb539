"""Rows captured in an engine worker process for sinks in the engine's process: gathered
into a :class:`~genlm_backend.llm.row_ring.RowRing` both processes map (or arrays) in
the worker, handed to their sinks here (see :mod:`genlm_backend.llm.vllm.internals.remote`
for when each runs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import row_ring
from . import capture
from .capture import _SINKS, LogprobsCaptureProcessor, _final_rows, _rows_of, _Staging
from .forcing import ForcedSampling

__all__ = ["RemoteParts", "RemoteRows", "deliver_remote", "gather_remote"]


class RemoteRows:
    """The rows of one engine step for sinks in another process, gathered in a worker.

    Installed in the worker whose step output the engine reads
    (:func:`~genlm_backend.llm.vllm.internals.install_remote_capture`): the capture processor gives
    it the final rows of every tag whose sink is not in this process. Their log-softmax goes into
    the :class:`~genlm_backend.llm.row_ring.RowRing` shared with the engine's process, and the
    step's output carries only where they are; without a ring (or for a step with more rows than it
    holds) the rows leave the device as one ``[k, V]`` array per sink. :meth:`take` hands
    the step's parts over to be sent with its output.
    """

    def __init__(
        self, discarded: Callable[[int], Any] | None, ring: Any = None, early: bool = False
    ):
        self.discarded = discarded  # as CaptureSink.discarded, read in this process
        self.ring = ring
        self.early = early  # rows are gathered before sampling (gather_remote), not in apply
        self.parts: list[tuple[str, list[int], Any]] = []

    def capture(self, logits: torch.Tensor, rows: dict[int, tuple[str, int, list[int]]], token: str,
                staging: _Staging) -> None:
        final = _final_rows(rows, self.discarded, logits.shape[0], token)
        if not final:
            return
        ring = self.ring
        fits = ring is not None and ring.rows.shape[1] == logits.shape[1]
        start = ring.claim(len(final)) if fits else None
        with torch.inference_mode(False), torch.no_grad():
            picked = _rows_of(logits, [i for i, _ in final], staging)
            if start is not None:
                slots = ring.slots(start, len(final))
                torch.log_softmax(picked, dim=-1, dtype=torch.float32, out=slots)
                self.parts.append((token, [tag for _, tag in final], (start, len(final))))
                return
            captured = torch.log_softmax(picked, dim=-1, dtype=torch.float32).cpu()
        # A NumPy array pickles its memory out of band (protocol 5), which the engine's
        # message queue sends as is; a tensor would be pickled by ``torch.save`` into the
        # message (vLLM 0.26: several copies, ~0.1 s a step for 64 rows of 131k).
        self.parts.append((token, [tag for _, tag in final], captured.numpy()))

    def take(self) -> list[tuple[str, list[int], Any]] | None:
        """This step's rows as ``(sink token, tags, where)`` parts, or None; ``where`` is
        ``(first slot, count)`` in the ring or the rows ``[len(tags), V]`` as a NumPy array."""
        parts, self.parts = self.parts, []
        return parts or None


def gather_remote(processors: Any, logits: torch.Tensor, remote: RemoteRows) -> list | None:
    """In a worker, after the forward pass and before sampling: the step's rows for the
    engine's process, from the capture processors among ``processors``, as
    :meth:`RemoteRows.take` parts (None: no rows). Rows in device memory are complete
    when this returns, so the engine's process may read them at once."""
    for processor in processors:
        if isinstance(processor, LogprobsCaptureProcessor):
            processor.gather_remote(logits, remote)
    parts = remote.take()
    if parts is not None and logits.is_cuda:
        torch.cuda.current_stream(logits.device).synchronize()
    return parts


def deliver_remote(
    parts: list[tuple[str, list[int], Any]], ring: Any = None
) -> dict[str, dict[int, int]] | None:
    """Hands rows that a worker process gathered (:meth:`RemoteRows.take`) to their sinks:
    copied out of ``ring`` (this process's map of the worker's), or out of the arrays (the
    message queue may hand them over as views of its reusable shared-memory slots). Then
    each sink's ``on_step`` hook names the tokens to force after them: returns those,
    ``{sink token: {tag: token}}``, or None."""
    decisions = None
    for token, tags, where in parts:
        sink = _SINKS.get(token)
        if sink is None:
            continue
        rows = ring.read(*where) if type(where) is tuple else torch.tensor(where)
        follower = sink._followers.get  # (a followed tag's row goes straight to its target)
        for tag, row in zip(tags, rows.unbind(0)):
            target = follower(tag)
            if target is not None:
                target(row)
            else:
                sink.receive(tag, row)
        if sink.on_step is not None:
            forced = sink.on_step(tags)
            if forced:
                decisions = {} if decisions is None else decisions
                decisions.setdefault(token, {}).update(forced)
    return decisions


class RemoteParts:
    """What :func:`~genlm_backend.llm.vllm.internals.install_remote_capture` is given of the
    modules above it: the rows' ring, gatherer and hand-over, and the forcing of tokens. It
    travels pickled to the worker processes, and looks its parts up when called."""

    read_lag = row_ring.READ_LAG

    def deliver(self, parts: list, ring: Any) -> dict[str, dict[int, int]] | None:
        return deliver_remote(parts, ring)

    def open_ring(self, handle: tuple) -> row_ring.RowRing:
        return row_ring.open_ring(handle)

    def create_ring(self, max_rows: int, depth: int, width: int, device: Any,
                    lag: int) -> row_ring.RowRing:
        return row_ring.RowRing.create(max_rows, depth, width, device, lag)

    def forcing(self) -> ForcedSampling:
        return ForcedSampling()

    def set_decisions(self, decisions: dict[str, dict[int, int]] | None) -> None:
        capture.set_decisions(decisions)

    def new_rows(self, discarded: Callable[[int], Any] | None, ring: Any,
                 early: bool) -> RemoteRows:
        return RemoteRows(discarded, ring, early)

    def set_remote(self, remote: RemoteRows) -> None:
        capture.set_remote(remote)

    def gather(self, processors: Any, logits: torch.Tensor, remote: RemoteRows) -> list | None:
        return gather_remote(processors, logits, remote)
