"""`ProcessReplica`: a backend in a process of its own, used from this one as an
:class:`~genlm_backend.llm.base.AsyncLM`.

What a replica of :class:`~genlm_backend.llm.replicas.ReplicatedLM` does between batches
(its scheduler, its sessions, its engine's bookkeeping) is Python: replicas in one process
take turns at its interpreter lock, so k replicas there are no faster than one. In a process
of its own (:mod:`~genlm_backend.llm.replicas.serve`, started with ``python -m``, so the
caller's script is not imported again), a replica runs the fastest single-engine route (its
model in its own process, held sessions) beside the others. This process sends each batch
as handles and tokens (a request that extends one sent before is its handle and one token)
and copies the rows out of a ring the replica writes (device memory shared by CUDA IPC,
mapped on the device with the same UUID here; a shared file on a CPU), on a reader thread
of its own, so the copies of several replicas overlap each other and the event loop.

A replica whose process exits fails its requests in flight and every later one with an
:class:`~genlm_backend.exceptions.EngineError`; nothing else waits on it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import itertools
import threading
import time
from typing import Any

import torch

from ...exceptions import ClosedError, EngineError
from ..base import AsyncLM, LogprobsRequest
from .serve import Child

__all__ = ["ProcessReplica", "start_replicas"]

# Handles are kept in two generations; a new one starts when the newest holds at least
# MIN_REMEMBER handles and as many as the one before (a lockstep sampler: every batch), or
# REMEMBER handles.
MIN_REMEMBER = 64
REMEMBER = 8192
# The replicas started by start_replicas while the collector's startup heap is frozen.
_HOLDING_GC: set[int] = set()


class ProcessReplica(AsyncLM):
    """A backend (``"vllm"``, ``"hf"`` or ``"mock"``) built by ``from_name(model_name,
    **kwargs)`` in a child process, served to this one.

    Rows come as fp32 tensors on ``device`` (default: the device they were computed on, as
    this process names it). Log-probability batches, ``sample``, adapters, ``clear_cache``
    and ``stats`` reach the child; :meth:`cleanup` ends it.

    Use :func:`start_replicas` to start several at once (their engines start side by side).

    Args:
        backend: which backend the child builds.
        model_name: the model (a local folder or a hub id).
        kwargs: the backend's ``from_name`` keyword arguments (picklable).
        visible_devices: the child's ``CUDA_VISIBLE_DEVICES`` entries (None: this process's).
        device: where rows are delivered here.
        timeout: as for :class:`~genlm_backend.llm.base.AsyncLM` (for calls made on this
            object directly, as are the next three).
        cache_size: rows kept in this object's output cache.
        cache_opts: extra keyword arguments of that cache.
        flush: when this object's batches run (``"idle"`` or ``"timer"``).

    Raises:
        EngineError: the child could not build the backend (its error is the cause), or
            exited before it was ready.
    """

    def __init__(self, backend: str, model_name: str, kwargs: dict | None = None, *,
                 visible_devices: list[str] | None = None, device: str | torch.device | None = None,
                 timeout: float = 0.02, cache_size: int = 0, cache_opts: dict | None = None,
                 flush: str = "idle"):
        child = Child(backend, model_name, kwargs or {}, visible_devices)
        self._setup(child, child.wait_ready(), device, timeout=timeout, cache_size=cache_size,
                    cache_opts=cache_opts, flush=flush)

    @classmethod
    def _of(cls, child: Child, info: dict, device: Any) -> ProcessReplica:
        replica = cls.__new__(cls)
        replica._setup(child, info, device)
        return replica

    def _setup(self, child: Child, info: dict, device: Any, **options: Any) -> None:
        self._child = child
        self._vocab_size = int(info["vocab_size"])
        self._max_prompt_len = info["max_prompt_len"]
        try:
            super().__init__(info["tokenizer"], batch_size=int(info["batch_size"]), **options)
        except BaseException:
            child.close()
            raise
        self.device = None if device is None else torch.device(device)
        self.pid = child.process.pid
        self._conn = child.conn
        self._send_lock = threading.Lock()
        self._batches = itertools.count(1)
        self._handles = itertools.count(1)
        # request key -> (handle, token_ids, lora_name); two generations, as in the child
        self._known: dict[int, tuple] = {}
        self._known_old: dict[int, tuple] = {}
        # batch -> (future, loop, count of requests, when sent)
        self._pending: dict[int, tuple] = {}
        # seconds: a batch's message to its reply, copying its rows out
        self.timings = {"num_batches": 0, "round_trip_s": 0.0, "read_s": 0.0}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._ring: Any = None
        self._failure: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="genlm-replica-reader", daemon=True)
        self._reader.start()

    # ---- what AsyncLM needs -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_prompt_len(self) -> int | None:
        return self._max_prompt_len

    _evaluates_on_loop = True

    def _evaluate_logprobs(self, requests: list[LogprobsRequest]) -> Any:
        """On the event loop: sends the batch; returns a future of its rows."""
        if self._failure is not None:
            raise self._failed()
        newest = len(self._known)
        rotate = newest >= REMEMBER or newest >= max(MIN_REMEMBER, len(self._known_old))
        if rotate:
            self._known_old, self._known = self._known, {}
        entries = [self._entry(request) for request in requests]
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        batch = next(self._batches)
        self._pending[batch] = (future, loop, len(requests), time.perf_counter())
        try:
            self._send(("rows", batch, rotate, entries))
        except BaseException:
            self._pending.pop(batch, None)
            raise
        if self._failure is not None and self._pending.pop(batch, None) is not None:
            raise self._failed()  # the reader ended meanwhile and did not see this batch
        return future

    def _entry(self, request: LogprobsRequest) -> Any:
        """How the child learns ``request``: its handle if sent before, else the handle of its
        parent and its last token, else its ids (see :mod:`.serve`)."""
        known = self._lookup(request)
        if known is not None:
            return known
        handle = next(self._handles)
        self._known[request._hash] = (handle, request.token_ids, request.lora_name)
        parent = request.parent
        parent_handle = None if parent is None else self._lookup(parent)
        if parent_handle is not None:
            return (handle, request.lora_name, parent_handle, request.token_ids[-1])
        return (handle, request.lora_name, request.token_ids)

    def _lookup(self, request: LogprobsRequest) -> int | None:
        """The handle of a request sent before (kept in the newest generation), or None."""
        key = request._hash
        found = self._known.get(key)
        if found is None:
            found = self._known_old.get(key)
            if found is None:
                return None
        handle, token_ids, lora_name = found
        if lora_name != request.lora_name:
            return None
        if token_ids is not request.token_ids and token_ids != request.token_ids:
            return None
        self._known[key] = found
        return handle

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            self._conn.send(message)

    # ---- the reader thread ----------------------------------------------------------------

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError) as exc:
                self._end(EngineError(f"the replica's process {self.pid} exited ({exc!r})"))
                return
            kind = message[0]
            if kind == "rows":
                self._on_rows(*message[1:])
            elif kind == "done":
                _, call, error, value = message
                future = self._calls.pop(call, None)
                if future is not None:
                    future.set_exception(error) if error is not None else future.set_result(value)
            elif kind == "closed":
                self._end(ClosedError("the replica was cleaned up"))
                return

    def _on_rows(self, batch: int, start: int, errors: dict, inline: Any, ring: Any) -> None:
        pending = self._pending.pop(batch, None)
        if pending is None:  # failed here already: nobody reads its rows
            with contextlib.suppress(OSError):
                self._send(("ack", batch))
            return
        future, loop, size, sent = pending
        arrived = time.perf_counter()
        try:
            count = size - len(errors)
            if ring is not None:
                from ..row_ring import open_ring

                self._ring = open_ring(ring)
            block = None
            if inline is not None:
                block = torch.from_numpy(inline)
                if self.device is not None:
                    block = block.to(self.device)
            elif count:
                try:
                    block = _copied(self._ring.rows[start : start + count], self.device)
                finally:
                    self._send(("ack", batch))  # copied out: the child may write there again
            rows = iter(() if block is None else block.unbind(0))
            results = [errors[i] if i in errors else next(rows) for i in range(size)]
        except BaseException as exc:  # noqa: BLE001 - this batch's awaiters get it
            results = [EngineError(f"the rows of the replica's process could not be read: {exc!r}")
                       for _ in range(size)]
        timings = self.timings
        timings["num_batches"] += 1
        timings["round_trip_s"] += arrived - sent
        timings["read_s"] += time.perf_counter() - arrived
        try:
            loop.call_soon_threadsafe(_resolve, future, results)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    def _failed(self) -> BaseException:
        """A new error of this replica's end, for one caller (an instance raised again and
        again would gather every raise's traceback)."""
        failure = self._failure  # an EngineError or a ClosedError, never raised itself
        error = type(failure)(*failure.args)
        error.__cause__ = failure.__cause__
        return error

    def _end(self, failure: BaseException) -> None:
        """The child is gone: everything in flight and everything later fails."""
        self._failure = failure
        for batch in list(self._pending):
            future, loop, *_ = self._pending.pop(batch)
            try:
                loop.call_soon_threadsafe(_fail, future, self._failed())
            except RuntimeError:
                pass
        for call in list(self._calls):
            self._calls.pop(call).set_exception(self._failed())

    # ---- calls into the child -------------------------------------------------------------

    def _call(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._failure is not None:
            future.set_exception(self._failed())
            return future
        call = next(self._call_ids)
        self._calls[call] = future
        try:
            self._send(("call", call, method, args, kwargs))
        except OSError as exc:  # the child is gone; the reader may not have seen it yet
            self._calls.pop(call, None)
            future.set_exception(EngineError(f"the replica's process {self.pid} exited ({exc!r})"))
        return future

    def _load_lora(self, lora_name: str, lora_path: str) -> None:
        self._call("add_new_lora", lora_path, lora_name).result()

    def _unload_lora(self, lora_name: str) -> None:
        self._call("remove_lora", lora_name).result()

    async def sample(self, prompt_token_ids: Any, max_tokens: int, eos_token_ids: Any,
                     temperature: float = 1.0, seed: int | None = None,
                     **options: Any) -> list[int]:
        """The child backend's ``sample`` (with its options)."""
        self._check_open()
        prompt = list(self._request(prompt_token_ids, None).token_ids)
        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids or ())
        return await asyncio.wrap_future(
            self._call("sample", prompt, max_tokens, eos, temperature, seed, **options)
        )

    def clear_cache(self) -> None:
        """Empties the output cache here and the child backend's."""
        super().clear_cache()
        if not self.is_closed and self._failure is None:
            self._call("clear_cache").result()

    def stats(self) -> dict[str, Any]:
        """This object's batching counters, with the child backend's ``stats()`` under
        ``process`` (with its ``pid``, and under ``server`` its ``num_batches`` and seconds in
        ``evaluate_s``, ``place_s`` (rows into the ring) and ``idle_s`` (between batches)),
        and under ``transport`` this side's ``num_batches`` and seconds in ``round_trip_s``
        (a batch sent to its reply) and ``read_s`` (its rows copied out)."""
        child = self._call("stats").result() if self._failure is None else None
        return {**super().stats(), "transport": dict(self.timings),
                "process": {"pid": self.pid, **(child or {})}}

    def _close(self) -> None:
        try:
            if self._ring is not None:
                self._ring.release()  # before the child frees the memory it maps
            self._child.close()
            self._reader.join(timeout=10)
        finally:
            _release_heap(self)


def start_replicas(backend: str, model_name: str, kwargs: dict, placements: list[list[str] | None],
                   device: Any = None) -> list[ProcessReplica]:
    """One :class:`ProcessReplica` per placement (its ``visible_devices``), started side by
    side; if one fails, the others are ended before its error goes on.

    Then, as vLLM's engine does where it runs in the caller's process (the default
    single-engine route), the heap is frozen for Python's collector (``gc.freeze()``): its
    full passes then skip the objects of the startup (torch, transformers, vLLM: about 400k
    objects, 100-200 ms a pass on a CPU), which otherwise run every few steps of a sampler
    with hundreds of particles. It is unfrozen once every replica started here is cleaned up.
    """
    children: list[Child] = []
    replicas: list[ProcessReplica] = []
    try:
        for placement in placements:
            children.append(Child(backend, model_name, kwargs, placement))
        for child in children:
            replicas.append(ProcessReplica._of(child, child.wait_ready(), device))
    except BaseException:
        for child in children[len(replicas):]:
            child.close(wait=10.0)
        for replica in replicas:
            replica.cleanup()
        raise
    if not _HOLDING_GC:
        gc.collect()
        gc.freeze()
    _HOLDING_GC.update(id(replica) for replica in replicas)
    return replicas


def _release_heap(replica: ProcessReplica) -> None:
    """``replica`` is cleaned up: the heap is unfrozen once no replica holds it."""
    if id(replica) in _HOLDING_GC:
        _HOLDING_GC.discard(id(replica))
        if not _HOLDING_GC:
            gc.unfreeze()


def _copied(rows: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A copy of ``rows`` on ``device`` (None: theirs), complete when this returns."""
    block = rows.clone() if device is None or device == rows.device else rows.to(device)
    for where in {rows.device, block.device}:
        if where.type == "cuda":
            torch.cuda.current_stream(where).synchronize()
    return block


def _resolve(future: asyncio.Future, results: list) -> None:
    if not future.done():
        future.set_result(results)


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
