"""Live engine sessions: a log-probability request that extends the context of an earlier one
costs one decode step instead of a new request over the whole context.

A *session* is one vLLM streaming-input request (see
:func:`~genlm_backend.llm.vllm_internals.add_session_chunk`) parked between chunks with its
KV cache. Each chunk has ``max_tokens=1`` and a capture tag: the row of its last token is
captured, the token vLLM samples for it is a throwaway that vLLM drops when the next chunk
comes (it is never computed into the KV cache). A session stands for the context whose row
it produced last.

Matching (:meth:`SessionPool.plan`): a request for context ``C`` (adapter ``A``) extends the
session of ``(A, C[:-1])`` by one token when that session is free in this batch. Particles
that share a context after resampling can extend it only once; the others open new sessions
(over the whole context: vLLM's prefix cache still skips most of the prefill). Requests that
find no room run as plain one-shot requests.

Bounds: at most ``capacity`` sessions live (below ``max_num_seqs``: a parked session holds a
scheduler slot, and the engine must keep one for everything else); a new session takes the
place of the least recently used free one; sessions unused for ``idle_batches`` batches are
closed. A chunk that fails, is refused or is aborted closes its session; only its own caller
sees the error. Everything here runs on the model's engine thread.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Session", "SessionPool"]

_ids = itertools.count()


@dataclass(eq=False)
class Session:
    """One parked streaming request: its engine id, adapter, and the context it stands for."""

    request_id: str
    lora_name: str | None
    context: tuple[int, ...] | None  # None while a chunk is in flight
    last_used: int = 0
    engine_request: Any = None  # the engine request of the last chunk, template of the next


class SessionPool:
    """The live sessions of one engine, keyed by ``(adapter, context)``.

    Args:
        abort: ``(request_ids) -> None``, aborts engine requests (closes their sessions).
        capacity: the most live sessions (0: none, every request is a plain request).
        idle_batches: a session unused for this many batches is closed.
    """

    def __init__(self, abort: Callable[[list[str]], None], capacity: int, idle_batches: int = 8):
        self._abort = abort
        self.capacity = max(int(capacity), 0)
        self.idle_batches = max(int(idle_batches), 1)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._by_key: dict[tuple[str | None, tuple[int, ...]], Session] = {}
        self._batch = 0
        self.num_extended = 0
        self.num_opened = 0
        self.num_closed = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def plan(self, requests: Sequence[Any]) -> list[tuple[Session, tuple[int, ...]] | None]:
        """Per request: ``(session, tokens to append)``, or None for a plain request.

        The sessions returned are busy until :meth:`settle`.
        """
        self._batch += 1
        self._close_idle()
        plan: list[tuple[Session, tuple[int, ...]] | None] = [None] * len(requests)
        if self.capacity == 0:
            return plan
        busy: set[str] = set()
        for i, request in enumerate(requests):
            context = request.token_ids
            if len(context) < 2:
                continue
            session = self._by_key.get((request.lora_name, context[:-1]))
            if session is not None and session.request_id not in busy:
                busy.add(session.request_id)
                plan[i] = (session, context[-1:])
        for i, request in enumerate(requests):
            if plan[i] is not None:
                continue
            if len(self._sessions) >= self.capacity:
                victim = next((s for s in self._sessions.values() if s.request_id not in busy), None)
                if victim is None:
                    continue  # no room: a plain request
                self.close(victim)
            session = Session(f"genlm-session-{next(_ids)}", request.lora_name, None)
            self._sessions[session.request_id] = session
            self.num_opened += 1
            busy.add(session.request_id)
            plan[i] = (session, request.token_ids)
        for entry in plan:
            if entry is not None:
                session = entry[0]
                if session.context is not None:
                    self._by_key.pop((session.lora_name, session.context), None)
                    self.num_extended += 1
                session.context = None
                session.last_used = self._batch
                self._sessions.move_to_end(session.request_id)
        return plan

    def settle(self, requests: Sequence[Any], plan: Sequence[Any], jobs: Sequence[Any], results: Sequence[Any] | None) -> None:
        """After a batch: sessions whose chunk gave a row now stand for their request's context;
        the others (failed, refused, aborted, retried as plain requests) are closed."""
        for i, (request, entry) in enumerate(zip(requests, plan)):
            if entry is None:
                continue
            session = entry[0]
            ok = (
                results is not None
                and isinstance(results[i], torch.Tensor)
                and jobs[i].stream_id == session.request_id
                and session.request_id in self._sessions
            )
            if not ok:
                self.close(session)
                continue
            key = (request.lora_name, request.token_ids)
            old = self._by_key.get(key)
            if old is not None and old is not session:
                self.close(old)
            session.context = request.token_ids
            session.engine_request = jobs[i].stream_request
            self._by_key[key] = session

    def close(self, session: Session) -> None:
        """Closes one session (aborts its engine request); a closed session is a no-op."""
        if self._sessions.pop(session.request_id, None) is None:
            return
        if session.context is not None and self._by_key.get((session.lora_name, session.context)) is session:
            del self._by_key[(session.lora_name, session.context)]
        session.context = None
        self.num_closed += 1
        self._abort([session.request_id])

    def resize(self, capacity: int) -> None:
        """Sets the capacity; closes the least recently used sessions beyond it."""
        self.capacity = max(int(capacity), 0)
        while len(self._sessions) > self.capacity:
            self.close(next(iter(self._sessions.values())))

    def close_where(self, predicate: Callable[[Session], bool]) -> int:
        """Closes the sessions matching ``predicate``; returns how many."""
        victims = [s for s in self._sessions.values() if predicate(s)]
        for session in victims:
            self.close(session)
        return len(victims)

    def close_all(self) -> int:
        return self.close_where(lambda s: True)

    def free_parked(self, jobs: Sequence[Any]) -> bool:
        """Closes the parked sessions: all but those with a chunk of ``jobs`` still to run (the
        engine stalled)."""
        in_use = {job.stream_id for job in jobs if job.stream_id and not job.is_done}
        return self.close_where(lambda s: s.request_id not in in_use) > 0

    def _close_idle(self) -> None:
        horizon = self._batch - self.idle_batches
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used >= horizon or oldest.context is None:
                break
            self.close(oldest)

    def stats(self) -> dict[str, int]:
        return {
            "num_live": len(self._sessions),
            "num_opened": self.num_opened,
            "num_extended": self.num_extended,
            "num_closed": self.num_closed,
        }
