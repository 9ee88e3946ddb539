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

Where the rows are read before the step that wrote them samples (vLLM's engine core running
one step at a time, :mod:`genlm_backend.llm.vllm.internals.remote`), no step runs while its
rows wait: the engine's process waits for its copy at once (``lag=0``; the device is idle
then) and a ring of ``depth=0`` (``2 * max_rows`` slots) is enough, so a 1 GiB ring holds
a step of 1024 rows of a 131k vocabulary.

Devices: a worker whose process sees other GPUs than this one (started with another
``CUDA_VISIBLE_DEVICES``) makes its ring on what it calls ``cuda:0``, which this process
may call ``cuda:1``. A CUDA handle carries
the device's UUID, and :func:`open_ring` maps the ring on the device of this process that
has that UUID (:func:`local_device_index`), so its rows arrive on the worker's own GPU.
"""

from __future__ import annotations

import collections
import inspect
import os
import tempfile
from collections.abc import Callable

import torch

__all__ = ["READ_LAG", "RowRing", "device_uuid", "local_device_index", "open_ring"]

READ_LAG = 2  # reads between copying a step's rows and making sure the copy is done


class RowRing:
    """``num_slots`` rows of ``width`` fp32 values; at most ``max_rows`` written per step."""

    def __init__(
        self, rows: torch.Tensor, max_rows: int, path: str | None = None, lag: int = READ_LAG
    ):
        self.rows = rows  # [num_slots, width]
        self.max_rows = int(max_rows)
        self.path = path  # the backing file of a CPU ring (None: device memory)
        self._cursor = 0
        self.lag = int(lag)  # reads between copying a step's rows and waiting for that copy
        # CUDA events of the last reads' copies
        self._copies: collections.deque = collections.deque()

    @classmethod
    def create(
        cls, max_rows: int, depth: int, width: int, device: torch.device | str,
        lag: int = READ_LAG,
    ) -> RowRing:
        """A new ring in this process (the worker's), for ``max_rows`` rows a step,
        ``depth`` steps run beyond the one being read and ``lag`` reads before a copy is
        waited for."""
        device = torch.device(device)
        num_slots = (max(int(depth), 0) + max(int(lag), 0) + 2) * int(max_rows)
        if device.type == "cpu":
            fd, path = tempfile.mkstemp(prefix="genlm-rows-")
            os.close(fd)
            rows = torch.from_file(path, shared=True, size=num_slots * width, dtype=torch.float32)
            return cls(rows.view(num_slots, width), max_rows, path, lag)
        rows = torch.empty((num_slots, width), dtype=torch.float32, device=device)
        return cls(rows, max_rows, lag=lag)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)

    def handle(self) -> tuple:
        """What :func:`open_ring` needs to map this ring in another process (picklable)."""
        if self.path is not None:
            return ("file", self.path, self.shape, self.max_rows)
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(self.rows)
        return ("cuda", rebuild, args, self.max_rows, device_uuid(self.rows.device))

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
        before later work on this process's current stream; the copy of ``lag`` reads back
        (this one, for ``lag=0``) is complete when this returns, so the worker may write over
        those slots."""
        copied = self.rows[start : start + count].clone()
        if copied.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(copied.device))
            self._copies.append(done)
            while len(self._copies) > self.lag:
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
        _, rebuild, args, max_rows, *uuid = handle
        args = _on_local_device(rebuild, args, uuid[0] if uuid else None)
        return RowRing(rebuild(*args), max_rows)
    raise ValueError(f"unknown row ring kind {kind!r}")


def device_uuid(device: torch.device | int) -> str | None:
    """The UUID of a CUDA device (the same in every process, whatever it calls the device),
    or None where torch does not tell it."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return None if uuid is None else str(uuid)


def local_device_index(uuid: str | None, index: int, uuids: list[str | None]) -> int:
    """The index, in a process whose devices have ``uuids`` (in order), of the device with
    ``uuid``, which the process that made the handle called ``index``; ``index`` itself where
    the UUID is unknown or not among this process's devices (both processes see the same
    devices then, or the handle cannot be mapped better)."""
    if uuid is not None:
        for local, other in enumerate(uuids):
            if other == uuid:
                return local
    return index


def _on_local_device(rebuild: Callable, args: tuple, uuid: str | None) -> tuple:
    """``args`` of torch's ``rebuild_cuda_tensor`` with the device index of this process
    that has ``uuid`` (a worker's ``cuda:0`` may be this process's ``cuda:1``)."""
    if uuid is None:
        return args
    try:
        position = list(inspect.signature(rebuild).parameters).index("storage_device")
    except (ValueError, TypeError):  # another torch's rebuild function: keep its index
        return args
    index = int(args[position])
    uuids = [device_uuid(i) for i in range(torch.cuda.device_count())]
    local = local_device_index(uuid, index, uuids)
    if local == index:
        return args
    return (*args[:position], local, *args[position + 1 :])
