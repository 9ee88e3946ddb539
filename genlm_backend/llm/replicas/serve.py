"""The process of a :class:`~genlm_backend.llm.replicas.process.ProcessReplica`: one backend,
serving the batches its parent sends over a socket (:func:`main`, in the child), and how the
parent starts, waits for and ends it (:class:`Child`).

Started as ``python -m genlm_backend.llm.replicas.serve FD`` (``FD``: this process's end of a
socket pair), so a caller's script is never imported again here. The backend evaluates each
batch with its own held sessions and engine, as it would in the caller's process; what
crosses the socket per batch is small:

- parent to here: ``("rows", batch, rotate, entries)``, one entry per request: an int (a
  request sent before, by its handle), ``(handle, lora, parent_handle, token)`` (the request
  of ``parent_handle`` extended by one token) or ``(handle, lora, token_ids)``. Both sides
  keep handles in two generations; ``rotate`` starts a new one on both sides at once, so
  they always agree on which handles are known;
- here to parent: ``("rows", batch, start, errors, inline, ring)``: the batch's rows are
  ``count`` consecutive rows of this process's row ring from slot ``start`` (the requests
  without an error, in order), ``errors`` maps positions to exceptions, ``inline`` carries
  the rows as an array where they do not fit the ring, and ``ring`` is the ring's handle
  on first use;
- the parent copies the rows out and answers ``("ack", batch)``: the ring's halves take
  turns, and a half is written again only once the batch that used it was acknowledged;
- ``("call", id, method, args, kwargs)`` runs one of the backend's methods (adapters,
  caches, stats, sampling) and answers ``("done", id, error, value)``; ``("close",)``
  cleans the backend up and ends the process, as does the parent's end of the socket
  closing.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

from ...exceptions import EngineError
from ..loading import load_model_by_name
from ..prompts import LogprobsRequest

__all__ = ["CALLS", "RING_BYTES", "Child", "main"]

# The backend methods the parent may call.
CALLS = ("add_new_lora", "remove_lora", "clear_cache", "stats", "sample")
# A ring holds at most this many bytes (two halves; a batch beyond one half comes inline).
RING_BYTES = 2**30


class Child:
    """A replica's process as its parent sees it: started on one end of a socket pair,
    asked to build its backend, waited for, ended."""

    def __init__(self, backend: str, model_name: str, kwargs: dict,
                 visible_devices: list[str] | None):
        self.model_name = model_name
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # The child imports this package from where this process did (not only when installed).
        package = sys.modules["genlm_backend"].__file__
        root = os.path.dirname(os.path.dirname(os.path.abspath(package)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in visible_devices)
        if "OMP_NUM_THREADS" not in env and _on_gpu():
            # One CPU thread for torch's own ops, as vLLM gives its GPU worker processes:
            # k replicas each with a pool of every core's threads spin against each other.
            env["OMP_NUM_THREADS"] = "1"
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "genlm_backend.llm.replicas.serve", str(theirs.fileno())],
                pass_fds=[theirs.fileno()], env=env,
            )
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(("start", backend, model_name, kwargs))

    def wait_ready(self) -> dict:
        """The child's description of its backend, once built.

        Raises:
            EngineError: the build failed or the child exited first.
        """
        while not self.conn.poll(0.5):
            if self.process.poll() is not None:
                self.conn.close()
                code = self.process.returncode
                raise EngineError(f"the replica's process exited with code {code} before it was "
                                  "ready")
        try:
            message = self.conn.recv()
        except EOFError as exc:
            self.close()
            raise EngineError("the replica's process exited before it was ready") from exc
        if message[0] != "ready":
            self.close()
            error = EngineError(f"the replica's process could not build its backend:\n{message[2]}")
            raise error from message[1]
        info = message[1]
        if info["tokenizer"] is None:
            from transformers import AutoTokenizer

            info["tokenizer"] = AutoTokenizer.from_pretrained(self.model_name)
        return info

    def close(self, wait: float = 60.0) -> None:
        """Asks the child to clean up and exit; kills it if it has not within ``wait`` s."""
        try:
            self.conn.send(("close",))
        except OSError:
            pass
        deadline = time.monotonic() + wait
        while self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.conn.close()


def _on_gpu() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


class Server:
    """Serves one backend's batches and calls, on this process's event loop."""

    def __init__(self, lm: Any, conn: Connection, loop: asyncio.AbstractEventLoop):
        self.lm, self.conn, self.loop = lm, conn, loop
        self.known: dict[int, Any] = {}  # handle -> request, the newest generation
        self.known_old: dict[int, Any] = {}
        self.ring: Any = None  # [2 * half, V] rows, made on the first batch's device
        self.half = 0
        self.turn = 0  # the half the next batch writes
        self.free = [asyncio.Event(), asyncio.Event()]
        self.owner: list[int | None] = [None, None]
        for event in self.free:
            event.set()
        self.closed = loop.create_future()
        # seconds: a batch's message to its rows, writing them to the ring, between batches
        self.timings = {"num_batches": 0, "evaluate_s": 0.0, "place_s": 0.0, "idle_s": 0.0}
        self._replied = None  # when the last batch's rows went out

    # ---- messages ------------------------------------------------------------------------

    def dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "rows":
            self.on_rows(*message[1:])
        elif kind == "ack":
            self.on_ack(message[1])
        elif kind == "call":
            self.loop.create_task(self.on_call(*message[1:]))
        elif kind == "close" and not self.closed.done():
            self.closed.set_result(True)

    def on_rows(self, batch: int, rotate: bool, entries: list) -> None:
        received = time.perf_counter()
        if self._replied is not None:
            self.timings["idle_s"] += received - self._replied
        if rotate:
            self.known_old, self.known = self.known, {}
        try:
            requests, broken = [], None
            for entry in entries:  # every entry's handle is learnt, also after one fails
                try:
                    requests.append(self.request_of(entry))
                except Exception as exc:  # noqa: BLE001 - fails the batch, after the loop
                    broken = broken or EngineError(
                        f"the replica could not read request {entry!r:.60}: {exc!r}")
            if broken is not None:
                raise broken
            lm = self.lm
            if lm._evaluates_on_loop:
                result = lm._evaluate_logprobs(requests)
            else:
                submitted = lm._engine_thread.submit(lm._evaluate_logprobs, requests)
                result = asyncio.wrap_future(submitted)
        except Exception as exc:  # noqa: BLE001 - fails this batch only
            result = exc
        self.loop.create_task(self.reply_rows(batch, len(entries), result, received))

    def request_of(self, entry: Any) -> Any:
        if type(entry) is int:
            request = self.known.get(entry) or self.known_old[entry]
            self.known[entry] = request
            return request
        if len(entry) == 4:
            handle, lora, parent_handle, token = entry
            parent = self.known.get(parent_handle) or self.known_old[parent_handle]
            self.known[parent_handle] = parent  # kept as the parent process keeps it
            parent.parent = None  # no chains of requests kept alive
            request = LogprobsRequest(parent.token_ids + (token,), lora, parent)
        else:
            handle, lora, token_ids = entry
            request = LogprobsRequest(tuple(token_ids), lora)
        self.known[handle] = request
        return request

    async def reply_rows(self, batch: int, size: int, result: Any, received: float) -> None:
        errors: dict[int, BaseException] = {}
        start, inline, ring = 0, None, None
        try:
            if isinstance(result, BaseException):
                raise result
            results = list(await result) if isinstance(result, asyncio.Future) else list(result)
            if len(results) != size:
                raise RuntimeError(f"the backend returned {len(results)} rows for {size} requests")
            import torch

            rows = []
            for i, row in enumerate(results):
                if isinstance(row, torch.Tensor):
                    rows.append(row)
                else:
                    failed = isinstance(row, BaseException)
                    errors[i] = row if failed else TypeError(f"not a row: {row!r}")
            evaluated = time.perf_counter()
            if rows:
                start, inline, ring = await self.place(batch, rows)
            timings = self.timings
            timings["evaluate_s"] += evaluated - received
            timings["place_s"] += time.perf_counter() - evaluated
            timings["num_batches"] += 1
        except Exception as exc:  # noqa: BLE001 - every request of the batch gets it
            errors = {i: exc for i in range(size)}
        self.send(("rows", batch, start, _picklable(errors), inline, ring))
        self._replied = time.perf_counter()

    async def place(self, batch: int, rows: list) -> tuple[int, Any, Any]:
        """Writes ``rows`` into the ring's next half (once the parent has copied what was
        there); returns the first slot, the rows inline where they do not fit, and the
        ring's handle where it is new."""
        import torch

        handle = None
        if self.ring is None:
            handle = self.make_ring(rows[0])
        first = rows[0]
        uniform = all(r.shape == first.shape and r.dtype == torch.float32
                      and r.device == first.device for r in rows)
        if self.half == 0 or len(rows) > self.half or not uniform:
            return 0, torch.stack(rows).cpu().numpy(), handle
        turn = self.turn
        self.turn ^= 1
        free = self.free[turn]
        await free.wait()
        free.clear()
        self.owner[turn] = batch
        start = turn * self.half
        torch.stack(rows, out=self.ring.rows[start : start + len(rows)])
        if self.ring.rows.is_cuda:
            torch.cuda.synchronize(self.ring.rows.device)  # written before the parent reads
        return start, None, handle

    def make_ring(self, row: Any) -> tuple | None:
        from ..row_ring import RowRing

        width = int(row.shape[-1])
        fits = RING_BYTES // (2 * 4 * width)
        self.half = min(int(self.lm.batch_size), fits) if row.dim() == 1 else 0
        if self.half == 0:
            self.ring = False
            return None
        self.ring = RowRing.create(self.half, 0, width, row.device, lag=0)
        return self.ring.handle()

    def on_ack(self, batch: int) -> None:
        for turn in (0, 1):
            if self.owner[turn] == batch:
                self.owner[turn] = None
                self.free[turn].set()

    async def on_call(self, call: int, method: str, args: tuple, kwargs: dict) -> None:
        error, value = None, None
        try:
            if method not in CALLS:
                raise ValueError(f"no such call: {method!r}")
            value = getattr(self.lm, method)(*args, **kwargs)
            if asyncio.iscoroutine(value):
                value = await value
            if method == "stats":
                value = {**value, "server": dict(self.timings)}
        except Exception as exc:  # noqa: BLE001 - goes to the caller
            error = exc
        self.send(("done", call, _picklable({0: error})[0] if error is not None else None, value))

    def send(self, message: tuple) -> None:
        with contextlib.suppress(OSError):  # the parent is gone: the reader ends this process
            self.conn.send(message)


def _picklable(errors: dict[int, BaseException]) -> dict[int, BaseException]:
    """``errors`` with each exception that cannot be pickled replaced by a RuntimeError."""
    out = {}
    for i, exc in errors.items():
        try:
            pickle.dumps(exc)
            out[i] = exc
        except Exception:  # noqa: BLE001 - any pickling failure
            out[i] = RuntimeError(f"{type(exc).__name__}: {exc}")
    return out


def _reader(conn: Connection, loop: asyncio.AbstractEventLoop, server: Server) -> None:
    """On a thread: hands every message to the loop; the socket closing closes the server."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("close",)
        try:
            loop.call_soon_threadsafe(server.dispatch, message)
        except RuntimeError:  # the loop is closed
            return
        if message[0] == "close":
            return


async def _serve(conn: Connection) -> None:
    start = conn.recv()
    _, backend, model_name, kwargs = start
    try:
        lm = load_model_by_name(model_name, backend, kwargs)
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("failed", _picklable({0: exc})[0], traceback.format_exc()))
        return
    # This process is ours: its startup heap is left out of the collector's full passes.
    gc.collect()
    gc.freeze()
    try:
        info = {"vocab_size": lm.vocab_size, "max_prompt_len": lm.max_prompt_len,
                "batch_size": lm.batch_size, "tokenizer": lm.tokenizer}
        try:
            conn.send(("ready", info))  # pickled whole before anything is written
        except OSError:
            raise
        except Exception:  # noqa: BLE001 - a tokenizer that cannot be pickled: the parent
            conn.send(("ready", {**info, "tokenizer": None}))  # loads it by name instead
        server = Server(lm, conn, asyncio.get_running_loop())
        threading.Thread(target=_reader, args=(conn, server.loop, server), daemon=True).start()
        await server.closed
    finally:
        lm.cleanup()
        gc.unfreeze()  # what the backend held goes before this process exits
        with contextlib.suppress(OSError):
            conn.send(("closed",))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    conn = Connection(int(argv[0]))
    try:
        asyncio.run(_serve(conn))
    finally:
        conn.close()


if __name__ == "__main__":
    main()
