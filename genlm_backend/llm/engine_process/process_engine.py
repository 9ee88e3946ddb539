"""`ProcessEngine`: an engine that runs in a process of its own, beside the program.

The engine (any :class:`~genlm_backend.llm.engine.Engine`) is built in a child process by a
function named at construction; this process keeps the front (:class:`~genlm_backend.llm.AsyncLM`:
checks, batching, cache) and the program. A batch goes to the child as a few integers a
request: a request that extends one sent in the last few batches by a token names that
request and its new token, so the child finds what its engine keeps for the earlier context
(its session) as it would in one process. Rows come back through memory both processes map
(:class:`.channel.SharedRows`), on the engine's device, and are copied out before they reach
their callers.

Should the child die, every pending awaiter gets :class:`~genlm_backend.exceptions.EngineError`
as soon as its end of the socket closes, and later batches are refused the same way. The
child ends itself when this process goes away (its socket closes), and :meth:`close` stops it
and waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from ...exceptions import ClosedError, EngineError
from ..prompts import LogprobsRequest
from . import channel

__all__ = ["CLOSE_WAIT_S", "ProcessEngine"]

# How long close() waits for the child to shut its engine down before killing it.
CLOSE_WAIT_S = 30.0
_CHILD_MAIN = "from genlm_backend.llm.engine_process.child import main; main()"
# The longest stats() waits for the child's answer.
STATS_WAIT_S = 10.0
# A request may name a parent request sent this many batches back at most (the child forgets
# older ones).
PARENT_BATCHES = 3


class ProcessEngine:
    """An engine built and run in a child process (see the module).

    Args:
        build: a function, importable by its module and name in a new process (defined at
            the top level of a module), that returns the engine: e.g.
            :func:`genlm_backend.llm.vllm.engine_process.vllm_engine`.
        *args: its positional arguments (picklable).
        **kwargs: its keyword arguments (picklable).

    Raises:
        TypeError: ``build`` cannot be imported by name in another process (defined in the
            main script or inside a function), or its arguments cannot be pickled.
        EngineError: the child could not build the engine (``__cause__``: its error, where
            it could be sent).

    Attributes:
        vocab_size, max_prompt_len: the engine's.
        max_num_seqs: the engine's ``max_num_seqs`` where it has one (else None).
        pid: the child's process id.
    """

    def __init__(self, build: Callable[..., Any], *args: Any, **kwargs: Any):
        spec = _build_spec(build, args, kwargs)  # checked before any process starts
        self._sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self._process = subprocess.Popen(
            [sys.executable, "-c", _CHILD_MAIN, str(child_sock.fileno())],
            pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal reaches the program, not it
        )
        child_sock.close()
        self.pid = self._process.pid
        self._send_lock = threading.Lock()
        self._pending: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future, int]] = {}
        self._queries: dict[int, concurrent.futures.Future] = {}
        self._state_lock = threading.Lock()
        self._failure: BaseException | None = None
        self._rows: channel.SharedRows | None = None
        self._batch = 0
        self._next_id = 0
        try:
            channel.send(self._sock, spec)
            hello = channel.receive(self._sock)
        except (OSError, EOFError) as exc:
            self._stop_child(0.0)
            raise EngineError(f"the engine process exited while starting (code "
                              f"{self._process.poll()})") from exc
        except BaseException:  # interrupted while the engine starts: it is not wanted
            self._process.kill()
            self._stop_child(CLOSE_WAIT_S)
            raise
        if hello[0] == "failed":
            self._stop_child(CLOSE_WAIT_S)
            raise EngineError(f"the engine process could not build the engine: {hello[2]}") \
                from hello[1]
        _, self.vocab_size, self.max_prompt_len, self.max_num_seqs = hello
        self._reader = threading.Thread(target=self._read, name="genlm-engine-process-reader",
                                        daemon=True)
        self._reader.start()

    # ---- the engine protocol ----------------------------------------------------------------

    def evaluate(self, requests: list[LogprobsRequest]) -> asyncio.Future:
        """On the event loop: sends the batch to the child; returns a future of its rows."""
        if self._failure is not None:
            raise self._failed_error()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        # Numbered and sent in one turn: the child reads the batches in the order numbered.
        with self._send_lock:
            batch = self._batch = self._batch + 1
            items = self._items(requests, batch)
            with self._state_lock:
                self._pending[batch] = (loop, future, len(requests))
            try:
                channel.send(self._sock, ("batch", batch, items))
            except OSError:
                with self._state_lock:
                    self._pending.pop(batch, None)
                raise self._failed_error() from None
        return future

    def _items(self, requests: list[LogprobsRequest], batch: int) -> list[tuple]:
        """What the child needs of each request: its id and hash, then its parent's id and
        its last token where the child still knows the parent, else its ids and adapter."""
        oldest = batch - PARENT_BATCHES + 1
        items = []
        for request in requests:
            wire_id = self._next_id = self._next_id + 1
            parent = request.parent
            kept = None if parent is None else parent.kept
            if type(kept) is tuple and kept[1] >= oldest:
                items.append((wire_id, request._hash, kept[0], request.token_ids[-1]))
            else:
                items.append((wire_id, request._hash, request.token_ids, request.lora_name))
            request.kept = (wire_id, batch)
        return items

    def stats(self) -> dict[str, Any]:
        """The engine's own counters (its ``stats()``, asked of the child; blocks for the
        answer), and ``engine_process``: the child's ``pid`` and whether it is ``running``."""
        running = self._failure is None
        child: dict[str, Any] = {}
        if running:
            query: concurrent.futures.Future = concurrent.futures.Future()
            try:
                with self._send_lock:
                    self._next_id += 1
                    key = self._next_id
                    with self._state_lock:
                        self._queries[key] = query
                    channel.send(self._sock, ("stats", key))
                child = query.result(timeout=STATS_WAIT_S)
            except (OSError, concurrent.futures.TimeoutError, EngineError, ClosedError):
                running = False
            finally:
                with self._state_lock:
                    self._queries.pop(key, None)
        return {**child, "engine_process": {"pid": self.pid, "running": running}}

    def close(self) -> None:
        """Fails pending batches with ``ClosedError``, asks the child to shut its engine down
        and waits for it to exit (at most :data:`CLOSE_WAIT_S`, then kills it)."""
        with self._state_lock:
            if self._failure is None:
                self._failure = ClosedError("the engine was closed")
            pending, self._pending = self._pending, {}
        for loop, future, _ in pending.values():
            _resolve_on(loop, future, None, ClosedError("the engine was closed"))
        try:
            with self._send_lock:
                channel.send(self._sock, ("close",))
        except OSError:
            pass
        self._stop_child(CLOSE_WAIT_S)

    # ---- the reader thread ------------------------------------------------------------------

    def _read(self) -> None:
        """Hands each reply's rows to its batch's future, until the child's end closes."""
        try:
            while True:
                message = channel.receive(self._sock)
                kind = message[0]
                if kind == "rows":
                    self._deliver(*message[1:])
                elif kind == "rows_ring":  # the first, or a larger one for a larger batch
                    _, description = message
                    fds = self._receive_fds()
                    if self._rows is not None:
                        self._rows.close()  # its copies are done: they are synchronous
                    self._rows = channel.SharedRows.open(description, fds)
                elif kind == "stats":
                    _, key, stats = message
                    query = self._queries.get(key)
                    if query is not None and not query.done():
                        query.set_result(stats)
                elif kind == "failed":
                    _, batch, error = message
                    self._finish(batch, None, error)
        except (OSError, EOFError, ValueError):
            pass
        finally:
            self._fail_everything()

    def _receive_fds(self) -> list[int]:
        _, fds, _, _ = socket.recv_fds(self._sock, 1, 4)
        return fds

    def _deliver(self, batch: int, where: tuple | None, inline: Any, errors: list) -> None:
        if where is not None:
            start, count, position = where
            rows = list(self._rows.copy_out(start, count, position).unbind(0))
        else:
            rows = [] if inline is None else list(inline.unbind(0))
        results: list[Any] = []
        errors_at = dict(errors)
        taken = iter(rows)
        entry = self._pending.get(batch)
        size = 0 if entry is None else entry[2]
        for i in range(size):
            results.append(errors_at[i] if i in errors_at else next(taken))
        self._finish(batch, results, None)

    def _finish(self, batch: int, results: list | None, error: BaseException | None) -> None:
        with self._state_lock:
            entry = self._pending.pop(batch, None)
        if entry is not None:
            loop, future, _ = entry
            _resolve_on(loop, future, results, error)

    def _fail_everything(self) -> None:
        try:  # the exit code, for the message (the child has closed its end: it is exiting)
            code = self._process.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            code = None
        with self._state_lock:
            if self._failure is None:
                self._failure = EngineError(
                    "the engine process exited" + ("" if code is None else f" (code {code})"))
            pending, self._pending = self._pending, {}
            queries, self._queries = self._queries, {}
        for loop, future, _ in pending.values():
            _resolve_on(loop, future, None, self._failed_error())
        for query in queries.values():
            if not query.done():
                query.set_exception(self._failed_error())

    def _failed_error(self) -> BaseException:
        failure = self._failure
        return type(failure)(str(failure))

    def _stop_child(self, wait_s: float) -> None:
        """Waits up to ``wait_s`` for the child to exit, then kills it; closes the socket."""
        try:
            self._process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5.0)
        if self._rows is not None:
            self._rows.close()
            self._rows = None


def _build_spec(build: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """What the child needs to call ``build(*args, **kwargs)``; raises where it could not."""
    module, name = getattr(build, "__module__", None), getattr(build, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        raise TypeError(
            f"ProcessEngine needs a build function the engine process can import by name, "
            f"defined at the top level of a module other than the main script; got {build!r}"
        )
    spec = (module, name, args, kwargs)
    try:
        pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(f"the arguments of {name} cannot be sent to the engine process: "
                        f"{exc}") from exc
    return spec


def _resolve_on(loop: asyncio.AbstractEventLoop, future: asyncio.Future, results: Any,
                error: BaseException | None) -> None:
    """Sets ``future`` (of ``loop``) from any thread; nothing where the loop has closed."""

    def resolve() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(results)

    try:
        loop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the loop was closed: nobody waits for the future any more
        pass
