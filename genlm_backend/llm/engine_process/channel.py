"""What passes between an engine process and the program's process: messages over a socket,
and rows in memory that both processes map.

A message is one pickled object behind its length. Rows do not travel in messages: the
engine process writes each batch's rows into :class:`SharedRows`, a ring of rows in device
memory shared through CUDA IPC (rows on a GPU) or in anonymous shared memory (rows on a CPU),
and its reply says where they are; the program's process copies them out. A counter in shared
memory says how far the copies have gone, so the engine process never writes over rows that
are still to be copied. Nothing is created in the file system: the shared memory is an
anonymous file (``memfd``) whose descriptor travels over the socket.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import pickle
import socket
import struct
import tempfile
from typing import Any

import numpy as np
import torch

__all__ = ["SharedRows", "frame", "receive", "receive_async", "send"]

_LENGTH = struct.Struct("<Q")
# The control block at the start of the shared memory: the reader's position (int64).
_CONTROL_BYTES = 64


def frame(message: Any) -> bytes:
    """One message as it goes over the socket."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)) + data


def send(sock: socket.socket, message: Any) -> None:
    """Sends one message (blocking; the caller keeps sends from different threads apart)."""
    sock.sendall(frame(message))


def receive(sock: socket.socket) -> Any:
    """The next message (blocking). Raises EOFError when the other process has gone."""
    (length,) = _LENGTH.unpack(_exactly(sock, _LENGTH.size))
    return pickle.loads(_exactly(sock, length))


async def receive_async(reader: asyncio.StreamReader) -> Any:
    """The next message from an asyncio stream; raises EOFError when the other side closed."""
    try:
        (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
        return pickle.loads(await reader.readexactly(length))
    except asyncio.IncompleteReadError as exc:
        raise EOFError("the other process closed the channel") from exc


def _exactly(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    while got < count:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError("the other process closed the channel")
        got += n
    return bytes(buffer)


def _anonymous_file(size: int) -> int:
    """A descriptor of ``size`` bytes of shared memory with no name in the file system."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("genlm-engine-rows", os.MFD_CLOEXEC)
    else:  # no memfd (macOS): a temporary file, unlinked at once
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, size)
    return fd


def _rows_in(memory: mmap.mmap, num_slots: int, width: int) -> torch.Tensor:
    """The rows of a CPU ring: its shared memory after the control block."""
    return torch.frombuffer(memory, dtype=torch.float32, offset=_CONTROL_BYTES,
                            count=num_slots * width).view(num_slots, width)


class SharedRows:
    """A ring of ``num_slots`` fp32 rows of ``width`` values, written by the engine process
    and copied out by the program's process.

    The writer takes consecutive slots for each batch from a cursor that goes back to slot 0
    when a batch does not fit before the end; positions count slots taken (skipped ones too)
    since the start. The reader sets the shared counter to the position up to which it has
    copied, after each batch's copy is complete; the writer takes slots only below that
    position plus ``num_slots``, and starts again at slot 0 whenever every row is copied.
    """

    def __init__(self, rows: torch.Tensor, memory: mmap.mmap, fd: int):
        self.rows = rows  # [num_slots, width], float32, on the rows' device
        self._memory = memory
        self._fd = fd
        self._copied = np.frombuffer(memory, dtype=np.int64, count=1)  # the reader's position
        self._cursor = 0  # the writer's slot and position
        self._position = 0

    @classmethod
    def create(cls, num_slots: int, width: int, device: torch.device) -> SharedRows:
        """A new ring (in the engine process) for rows on ``device``."""
        on_cpu = device.type == "cpu"
        size = _CONTROL_BYTES + (num_slots * width * 4 if on_cpu else 0)
        fd = _anonymous_file(size)
        memory = mmap.mmap(fd, size)
        if on_cpu:
            rows = _rows_in(memory, num_slots, width)
        else:
            rows = torch.empty((num_slots, width), dtype=torch.float32, device=device)
        return cls(rows, memory, fd)

    def handle(self) -> tuple[tuple, list[int]]:
        """What :meth:`open` needs in the other process: a picklable description and the
        descriptors to send beside it."""
        shape = tuple(self.rows.shape)
        if self.rows.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            return ("cuda", shape, reduce_tensor(self.rows)), [self._fd]
        return ("cpu", shape, None), [self._fd]

    @classmethod
    def open(cls, description: tuple, fds: list[int]) -> SharedRows:
        """Maps a ring that the other process made (:meth:`handle`)."""
        kind, (num_slots, width), cuda = description
        fd = fds[0]
        size = _CONTROL_BYTES + (num_slots * width * 4 if kind == "cpu" else 0)
        memory = mmap.mmap(fd, size)
        if kind == "cpu":
            rows = _rows_in(memory, num_slots, width)
        else:
            rebuild, args = cuda
            rows = rebuild(*args)
        return cls(rows, memory, fd)

    def claim(self, count: int) -> tuple[int, int] | None:
        """Writer: the first of ``count`` free consecutive slots and the position after them,
        or None while the reader has not copied enough (or ``count`` is over the ring)."""
        num_slots = self.rows.shape[0]
        if count > num_slots:
            return None
        if self._position == int(self._copied[0]):  # every row copied: start again at 0
            self._cursor = 0
        start = 0 if self._cursor + count > num_slots else self._cursor
        end = self._position + (num_slots - self._cursor if start == 0 and self._cursor else 0)
        end += count
        if end - int(self._copied[0]) > num_slots:
            return None
        self._cursor, self._position = start + count, end
        return start, end

    def fits(self, count: int) -> bool:
        return count <= self.rows.shape[0]

    def copy_out(self, start: int, count: int, position: int) -> torch.Tensor:
        """Reader: a copy of ``count`` rows from slot ``start``, complete when this returns;
        then the writer may use them again (up to ``position``)."""
        copied = self.rows[start : start + count].clone()
        if copied.is_cuda:
            torch.cuda.current_stream(copied.device).synchronize()
        self._copied[0] = position
        return copied

    def close(self) -> None:
        """Unmaps the ring in this process (after the last copy)."""
        self.rows = None
        self._copied = None
        try:
            self._memory.close()
        except BufferError:  # a tensor view of a CPU ring is still alive: the GC unmaps it
            pass
        os.close(self._fd)
