"""The child side of :class:`~.process_engine.ProcessEngine`: builds the engine, then serves
batches until the program's process closes the channel or asks it to stop."""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import sys
import threading
import traceback
from typing import Any

import torch

from ..prompts import LogprobsRequest
from . import channel
from .process_engine import CLOSE_WAIT_S, PARENT_BATCHES

# Ring slots: twice the engine's batch (max_num_seqs), and at least this many.
MIN_RING_ROWS = 256


def main() -> None:
    """The child's entry point: ``argv[1]`` is its end of the socket."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.set_inheritable(sock.fileno(), False)  # processes the engine starts do not keep it
    module, name, args, kwargs = channel.receive(sock)
    try:
        build = importlib.import_module(module)
        for part in name.split("."):
            build = getattr(build, part)
        engine = build(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        traceback.print_exc()
        channel.send(sock, ("failed", _picklable(exc), f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    max_num_seqs = getattr(engine, "max_num_seqs", None)
    channel.send(sock, ("ready", engine.vocab_size, engine.max_prompt_len, max_num_seqs))
    server = Server(sock, engine, 2 * max(int(max_num_seqs or 0), MIN_RING_ROWS // 2))
    try:
        asyncio.run(server.serve())
    finally:
        # Whether asked to or left alone, the engine is shut down (its own worker processes
        # with it); should that hang, the process ends anyway.
        timer = threading.Timer(CLOSE_WAIT_S, os._exit, args=(1,))
        timer.daemon = True
        timer.start()
        try:
            engine.close()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # not a plain exit: threads of the engine's library could linger


class Server:
    """Runs each batch that arrives through the engine and sends its rows back."""

    def __init__(self, sock: socket.socket, engine: Any, ring_rows: int):
        self.sock = sock
        self.engine = engine
        self.ring_rows = ring_rows
        self.rows: channel.SharedRows | None = None
        self.retired: list[channel.SharedRows] = []
        # wire id -> request, by the batch that sent it (the last PARENT_BATCHES batches)
        self.known: dict[int, dict[int, LogprobsRequest]] = {}
        self.writer: asyncio.StreamWriter | None = None
        self.write_lock = asyncio.Lock()

    async def serve(self) -> None:
        reader, self.writer = await asyncio.open_unix_connection(sock=self.sock)
        tasks = set()
        while True:
            try:
                message = await channel.receive_async(reader)
            except EOFError:  # the program's process has gone
                return
            if message[0] == "close":
                return
            if message[0] == "stats":
                stats = getattr(self.engine, "stats", None)
                self._send(("stats", message[1], {} if stats is None else stats()))
                continue
            _, batch, items = message
            task = asyncio.create_task(self.run(batch, self.requests(batch, items)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def requests(self, batch: int, items: list) -> list[LogprobsRequest]:
        known = self.known
        recent = known[batch] = {}
        known.pop(batch - PARENT_BATCHES, None)
        requests = []
        for wire_id, key, ids_or_parent, last_or_lora in items:
            if type(ids_or_parent) is int:  # extends a request of a recent batch by a token
                parent = self._find(ids_or_parent, batch)
                parent.parent = None  # no chains of requests kept alive
                request = LogprobsRequest(parent.token_ids + (last_or_lora,), parent.lora_name,
                                          parent, key=key)
            else:
                request = LogprobsRequest(ids_or_parent, last_or_lora, key=key)
            recent[wire_id] = request
            requests.append(request)
        return requests

    def _find(self, wire_id: int, batch: int) -> LogprobsRequest:
        for back in range(PARENT_BATCHES):
            found = self.known.get(batch - back, {}).get(wire_id)
            if found is not None:
                return found
        raise KeyError(f"request {wire_id} is not among the last {PARENT_BATCHES} batches")

    async def run(self, batch: int, requests: list[LogprobsRequest]) -> None:
        try:
            results = self.engine.evaluate(requests)
            if isinstance(results, asyncio.Future):
                results = await results
        except Exception as exc:  # noqa: BLE001 - the batch's callers get it
            self._send(("failed", batch, _picklable(exc)))
            return
        errors = [(i, _picklable(r)) for i, r in enumerate(results) if isinstance(r, BaseException)]
        rows = [r for r in results if not isinstance(r, BaseException)]
        async with self.write_lock:  # rows are written, and replies sent, one batch at a time
            where, inline = None, None
            if rows:
                where = await self._write(rows)
                if where is None:
                    inline = torch.stack([r.float().cpu() for r in rows])
            self._send(("rows", batch, where, inline, errors))

    async def _write(self, rows: list[torch.Tensor]) -> tuple[int, int, int] | None:
        """Writes ``rows`` into the ring (made at the first batch, on the rows' device);
        where they are, or None where they do not fit in it."""
        first = rows[0]
        if self.rows is None or not self.rows.fits(len(rows)):
            if self.rows is not None:  # a larger batch than the ring holds: a larger ring
                self.retired.append(self.rows)  # the other process may still be copying
            size = max(self.ring_rows, 2 * len(rows))
            self.rows = channel.SharedRows.create(size, first.shape[-1], first.device)
            description, fds = self.rows.handle()
            self._send(("rows_ring", description))
            while self.writer.transport.get_write_buffer_size():  # the fds go after it
                await asyncio.sleep(0.0002)
            socket.send_fds(self.sock, [b"F"], fds)
        ring = self.rows
        if first.device != ring.rows.device or first.shape[-1] != ring.rows.shape[1]:
            return None
        claimed = ring.claim(len(rows))
        while claimed is None:  # the program's process is still copying earlier rows
            await asyncio.sleep(0.0002)
            claimed = ring.claim(len(rows))
        start, position = claimed
        torch.stack(rows, out=ring.rows[start : start + len(rows)])
        if first.is_cuda:
            torch.cuda.synchronize(first.device)
        return start, len(rows), position

    def _send(self, message: Any) -> None:
        self.writer.write(channel.frame(message))


def _picklable(exc: BaseException) -> BaseException:
    """``exc`` where it pickles, else a RuntimeError that names it."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")
