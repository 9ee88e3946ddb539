"""One batch of :class:`~genlm_backend.llm.replicas.ReplicatedLM` spread over its replicas:
every replica's share starts at once; each replica's rows, or its errors, go to their
requests' places; the batch's rows come back once every share is in, on one device.

A replica that raises, returns the wrong number of rows, or was cleaned up fails its own
share only: each of its requests gets an error of its own (``EngineError``, or
``ClosedError``), the other replicas' rows arrive as usual. A row that a replica returns as
an exception instance fails that request only, as with any backend.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import torch

from ...exceptions import ClosedError, EngineError
from ..prompts import LogprobsRequest

__all__ = ["Gathering"]


class Gathering:
    """One batch spread over the replicas: starts every share, puts each replica's rows (or
    errors) in their requests' places, and hands back the rows once every share is in."""

    __slots__ = ("future", "lm", "remaining", "requests", "results", "shares")

    def __init__(self, lm: Any, requests: list[LogprobsRequest], shares: list[list[int]]):
        self.lm = lm
        self.requests = requests
        self.shares = shares
        self.results: list[Any] = [None] * len(requests)
        self.remaining = 0
        self.future: asyncio.Future | None = None

    def start(self) -> Any:
        loop = asyncio.get_running_loop()
        running = []
        for index, positions in enumerate(self.shares):
            if not positions:
                continue
            try:
                started = self.lm._start_share(index, [self.requests[i] for i in positions], loop)
            except Exception as exc:  # noqa: BLE001 - fails this replica's share only
                self._fill(index, positions, None, exc)
                continue
            if isinstance(started, asyncio.Future):
                running.append((index, positions, started))
            else:
                self._fill(index, positions, started, None)
        if not running:
            return self._rows()
        self.future = loop.create_future()
        self.remaining = len(running)
        for index, positions, started in running:
            started.add_done_callback(functools.partial(self._on_done, index, positions))
        return self.future

    def _on_done(self, index: int, positions: list[int], started: asyncio.Future) -> None:
        if started.cancelled():
            self._fill(index, positions, None, ClosedError("the replica's evaluation was cancelled"))
        else:
            error = started.exception()
            self._fill(index, positions, None if error is not None else started.result(), error)
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            try:
                self.future.set_result(self._rows())
            except Exception as exc:  # noqa: BLE001 - the batcher fails the batch's awaiters
                self.future.set_exception(exc)

    def _fill(self, index: int, positions: list[int], rows: Any, error: BaseException | None) -> None:
        if error is None:
            try:
                if len(rows) != len(positions):
                    error = RuntimeError(f"returned {len(rows)} rows for {len(positions)} requests")
            except TypeError:
                error = TypeError(f"returned {type(rows).__name__}, not a sequence of rows")
        results = self.results
        if error is not None:
            for i in positions:
                results[i] = _replica_error(index, len(positions), error)
            return
        for i, row in zip(positions, rows):
            results[i] = row

    def _rows(self) -> list[Any]:
        """The batch's rows, every tensor on the model's device."""
        lm, results = self.lm, self.results
        home = lm.device
        if home is None:  # replica 0's device, from its first row
            first = next((results[i] for i in self.shares[0] if isinstance(results[i], torch.Tensor)), None)
            if first is None:
                return results
            home = lm.device = first.device
        away = [i for i, row in enumerate(results) if isinstance(row, torch.Tensor) and row.device != home]
        if away:
            for i, row in zip(away, _moved([results[i] for i in away], home)):
                results[i] = row
        return results


def _moved(rows: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``rows`` on ``device``: one copy per source device (a stack), without waiting on a GPU.
    (A copy to the CPU waits: a non-blocking one could be read before it is done.)"""
    non_blocking = device.type == "cuda"
    by_source: dict[torch.device, list[int]] = {}
    for i, row in enumerate(rows):
        by_source.setdefault(row.device, []).append(i)
    out: list[Any] = [None] * len(rows)
    for positions in by_source.values():
        if len(positions) == 1:
            out[positions[0]] = rows[positions[0]].to(device, non_blocking=non_blocking)
            continue
        moved = torch.stack([rows[i] for i in positions]).to(device, non_blocking=non_blocking)
        for i, row in zip(positions, moved.unbind(0)):
            out[i] = row
    return out


def _replica_error(index: int, num_requests: int, error: BaseException) -> BaseException:
    """The error of one request of a replica's failed share: its own instance."""
    if isinstance(error, ClosedError):
        exc: BaseException = ClosedError(f"replica {index}: {error}")
    else:
        exc = EngineError(f"replica {index} failed on its {num_requests} requests of the batch: {error!r}")
    exc.__cause__ = error
    return exc
