"""Rows shared between an engine worker process and the engine's process.

Where vLLM's model runner is another process (``distributed_executor_backend="mp"``, tensor
parallelism), the capture processor runs there. Instead of sending each step's rows with the
step's output, it writes them into a :class:`RowRing` that both processes map (device memory
shared by CUDA IPC; a memory-mapped file on a CPU) and sends only where they are. The
engine's process copies them out when it handles that step's output, before the scheduler
plans any step that could write over them.

Reuse: a step's rows take consecutive slots from a cursor, which restarts at slot 0 when a
step's rows do not fit before the end. While the engine's process reads step k, the worker
may run at most ``depth`` steps beyond it (vLLM's batch queue: ``max_concurrent_batches - 1``,
one with async scheduling). The engine's process does not wait for its copy of a step's rows
(on a GPU that would wait for the worker's forward pass, which the device runs first: two
processes take turns on it); it waits for the copy of ``READ_LAG`` reads back, long done by
then. So ``depth + READ_LAG`` steps may run while a step's rows are still to be copied, and
with ``(depth + READ_LAG + 2) * max_rows`` slots and at most ``max_rows`` rows a step none
of them reaches its slots: for one of them to restart at 0, that step must start beyond
slot ``(depth + READ_LAG) * max_rows``, more than those steps can fill from 0.
"""

from __future__ import annotations

import collections
import os
import tempfile

import torch

__all__ = ["READ_LAG", "RowRing", "open_ring"]

READ_LAG = 2  # reads between copying a step's rows and making sure the copy is done


class RowRing:
    """``num_slots`` rows of ``width`` fp32 values; at most ``max_rows`` written per step."""

    def __init__(self, rows: torch.Tensor, max_rows: int, path: str | None = None):
        self.rows = rows  # [num_slots, width]
        self.max_rows = int(max_rows)
        self.path = path  # the backing file of a CPU ring (None: device memory)
        self._cursor = 0
        self._copies: collections.deque = collections.deque()  # CUDA events of the last reads' copies

    @classmethod
    def create(cls, max_rows: int, depth: int, width: int, device: torch.device | str) -> RowRing:
        """A new ring in this process (the worker's), for ``max_rows`` rows a step and
        ``depth`` steps run beyond the one being read."""
        device = torch.device(device)
        num_slots = (max(int(depth), 1) + READ_LAG + 2) * int(max_rows)
        if device.type == "cpu":
            fd, path = tempfile.mkstemp(prefix="genlm-rows-")
            os.close(fd)
            rows = torch.from_file(path, shared=True, size=num_slots * width, dtype=torch.float32)
            return cls(rows.view(num_slots, width), max_rows, path)
        return cls(torch.empty((num_slots, width), dtype=torch.float32, device=device), max_rows)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)

    def handle(self) -> tuple:
        """What :func:`open_ring` needs to map this ring in another process (picklable)."""
        if self.path is not None:
            return ("file", self.path, self.shape, self.max_rows)
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.rows)
        return ("cuda", rebuild, args, self.max_rows)

    def claim(self, count: int) -> int | None:
        """The first of ``count`` consecutive slots for one step's rows (in the worker);
        None when a step has more rows than the ring is sized for."""
        if count > self.max_rows:
            return None
        if self._cursor + count > self.rows.shape[0]:
            self._cursor = 0
        start, self._cursor = self._cursor, self._cursor + count
        return start

    def slots(self, start: int, count: int) -> torch.Tensor:
        return self.rows[start : start + count]

    def read(self, start: int, count: int) -> torch.Tensor:
        """A copy of ``count`` rows from slot ``start`` (in the engine's process), ordered
        before later work on this process's current stream; the copy of ``READ_LAG`` reads
        back is complete when this returns, so the worker may write over those slots."""
        copied = self.rows[start : start + count].clone()
        if copied.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(copied.device))
            self._copies.append(done)
            while len(self._copies) > READ_LAG:
                self._copies.popleft().synchronize()
        return copied

    def release(self) -> None:
        """Forgets this process's map of the ring, once the copies out of it are done (before
        the worker that made it exits: CUDA memory shared by its maker goes with it)."""
        while self._copies:
            self._copies.popleft().synchronize()
        self.rows = None


def open_ring(handle: tuple) -> RowRing:
    """Maps a ring made in another process (:meth:`RowRing.handle`). A CPU ring's file is
    removed once mapped here: both processes keep their mappings."""
    kind = handle[0]
    if kind == "file":
        _, path, (num_slots, width), max_rows = handle
        try:
            rows = torch.from_file(path, shared=True, size=num_slots * width, dtype=torch.float32)
        finally:
            os.unlink(path)
        return RowRing(rows.view(num_slots, width), max_rows)
    if kind == "cuda":
        _, rebuild, args, max_rows = handle
        return RowRing(rebuild(*args), max_rows)
    raise ValueError(f"unknown row ring kind {kind!r}")
