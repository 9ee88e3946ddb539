"""Live engine sessions: a log-probability request that extends the context of an earlier one
by a token costs one decode step of a request that is already running.

A *session* is one vLLM streaming-input request (see
:func:`~genlm_backend.llm.vllm_internals.add_session_chunk`) that stands for the context whose
row it produced last. It is in one of three states:

* ``running``: a chunk (its first prompt, or tokens appended to a parked session) or a
  continuation is in flight;
* ``held``: its row was just captured, inside the engine step that computed it, and the
  step waits (:meth:`~genlm_backend._engine_thread.EngineThread.hold`) for the next batch's
  plan. A request that extends its context by one token *continues* it: that token is
  forced as the session's next token (the capture processor sets every other logit to
  -inf), so the next step computes the new row as a plain decode step, without re-adding
  the request. Sessions the plan does not continue are parked;
* ``parked``: stopped with its KV cache (:func:`~genlm_backend.llm.vllm_internals.park`, or
  a one-token chunk when holding is off); a request that extends it appends a chunk, which
  re-adds the request to the engine's batch once.

Matching (:meth:`SessionPool.plan`): a request for context ``C`` (adapter ``A``) uses the
session of ``(A, C[:-1])`` when that session is free in this batch; it is found through the
request's ``parent`` (the request of ``C[:-1]``, whose ``kept`` is the session standing for
it: no hashing of long contexts), else by value. Particles that share a
context after resampling can extend it only once; the others open new sessions (over the
whole context: vLLM's prefix cache still skips most of the prefill). Requests that find no
room run as plain one-shot requests.

Bounds: at most ``capacity`` sessions live (below ``max_num_seqs``: every session holds a
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

__all__ = ["PlanEntry", "Session", "SessionPool"]

_ids = itertools.count()


@dataclass(eq=False, slots=True)
class Session:
    """One live streaming request: its engine id, adapter, state and the request whose
    context it stands for (``key``; None while running)."""

    request_id: str
    lora_name: str | None
    key: Any = None  # LogprobsRequest
    state: str = "running"  # "running", "held" or "parked"
    tag: int | None = None  # capture tag of its current chunk (the same for continuations)
    job: Any = None  # the EngineJob in flight
    next_key: Any = None  # the request of the job in flight
    last_used: int = 0
    engine_request: Any = None  # the engine request of the last chunk, template of the next
    params: Any = None  # the SamplingParams of its last chunk (continuations reuse them)


@dataclass(slots=True)
class PlanEntry:
    """How one request runs: as a continuation of a held session (``tokens`` is its one new
    token) or as a chunk appended to a new or parked session (``tokens`` to add)."""

    session: Session
    tokens: tuple[int, ...]
    continues: bool


class SessionPool:
    """The live sessions of one engine, keyed by ``(adapter, context)``.

    Args:
        abort: ``(request_ids) -> None``, aborts engine requests (closes their sessions).
        park: ``(session) -> None``, stops a held session after the current step.
        capacity: the most live sessions (0: none, every request is a plain request).
        idle_batches: a session unused for this many batches is closed.
    """

    def __init__(
        self,
        abort: Callable[[list[str]], None],
        capacity: int,
        idle_batches: int = 8,
        park: Callable[[Session], None] | None = None,
    ):
        self._abort = abort
        self._park = park
        self.capacity = max(int(capacity), 0)
        self.idle_batches = max(int(idle_batches), 1)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._by_key: dict[Any, Session] = {}  # the request a session stands for -> session
        self._by_tag: dict[int, Session] = {}
        self._held: list[Session] = []
        self.decisions: dict[int, int] = {}  # tag -> token forced at the end of this step
        self.decided = False  # a plan has dealt with the held sessions
        self._batch = 0
        self.num_extended = 0
        self.num_continued = 0
        self.num_opened = 0
        self.num_closed = 0

    def __len__(self) -> int:
        return len(self._sessions)

    # ---- planning a batch -----------------------------------------------------------------

    def plan(self, requests: Sequence[Any]) -> list[PlanEntry | None]:
        """Per request (a ``LogprobsRequest``): how it runs through a session, or None for a
        plain request.

        Continuations set :attr:`decisions`; held sessions left out are parked. The sessions
        returned are running until their row arrives (:meth:`on_rows`) or :meth:`settle`.
        """
        self._batch += 1
        self._close_idle()
        plan: list[PlanEntry | None] = [None] * len(requests)
        busy: set[str] = set()
        if self.capacity > 0:
            by_key = self._by_key
            for i, request in enumerate(requests):
                context = request.token_ids
                if len(context) < 2:
                    continue
                parent = request.parent
                session = None if parent is None else parent.kept
                if session is None or session.key is not parent:
                    session = by_key.get(type(request)(context[:-1], request.lora_name))
                if session is not None and session.request_id not in busy:
                    busy.add(session.request_id)
                    plan[i] = PlanEntry(session, context[-1:], session.state == "held")
        self._park_held(exclude=busy)
        for i, request in enumerate(requests):
            if plan[i] is not None or self.capacity == 0:
                continue
            if len(self._sessions) >= self.capacity:
                victim = next((s for s in self._sessions.values() if s.request_id not in busy), None)
                if victim is None:
                    continue  # no room: a plain request
                self.close(victim)
            session = Session(f"genlm-session-{next(_ids)}", request.lora_name)
            self._sessions[session.request_id] = session
            self.num_opened += 1
            busy.add(session.request_id)
            plan[i] = PlanEntry(session, request.token_ids, False)
        batch, sessions, decisions = self._batch, self._sessions, self.decisions
        for request, entry in zip(requests, plan):
            if entry is None:
                continue
            session = entry.session
            if session.key is not None:
                self._forget_key(session)
                self.num_extended += 1
            if entry.continues:
                decisions[session.tag] = entry.tokens[0]
                self.num_continued += 1
            session.next_key = request
            session.state = "running"
            session.last_used = batch
            sessions.move_to_end(session.request_id)
        return plan

    def bind(self, entry: PlanEntry, job: Any, tag: int) -> None:
        """Records the job (and capture tag) that runs ``entry``'s session."""
        session = entry.session
        if session.tag != tag:
            if session.tag is not None:
                self._by_tag.pop(session.tag, None)
            self._by_tag[tag] = session
            session.tag = tag
        session.job = job
        if not entry.continues:
            session.params = job.params

    # ---- inside an engine step ------------------------------------------------------------

    def on_rows(self, tags: Sequence[int]) -> list[Session]:
        """The final rows of ``tags`` were captured this step: sessions whose job got its row
        now stand for its context and are held; returns them. A session row nobody waited
        for (its job failed) closes the session."""
        held = []
        for tag in tags:
            session = self._by_tag.get(tag)
            if session is None or session.state != "running":
                continue
            job = session.job
            if job is None or not isinstance(job.result, torch.Tensor):
                self.close(session)
                continue
            self._stand_for(session, job)
            session.state = "held"
            held.append(session)
        self._held += held
        return held

    def release(self) -> dict[int, int]:
        """Ends this step's hold: parks the held sessions no plan continued; returns (and
        forgets) the tokens to force."""
        self._park_held(exclude=set())
        decisions, self.decisions = self.decisions, {}
        self.decided = False
        return decisions

    def _park_held(self, exclude: set[str]) -> None:
        for session in self._held:
            if session.request_id in exclude or session.state != "held":
                continue
            if self._park is None:
                self.close(session)
            else:
                self._park(session)
                session.state = "parked"
        self._held = [s for s in self._held if s.request_id in exclude]
        self.decided = True

    # ---- after a batch --------------------------------------------------------------------

    def settle(self, requests: Sequence[Any], plan: Sequence[PlanEntry | None], jobs: Sequence[Any]) -> None:
        """After a batch: sessions whose job failed (or was retried as a plain request) are
        closed; a chunk whose row came with its output (no holding) parks its session."""
        for request, entry, job in zip(requests, plan, jobs):
            if entry is None:
                continue
            session = entry.session
            ok = isinstance(job.result, torch.Tensor) and job.stream_id == session.request_id
            if not ok:
                if session.job is job:
                    self.close(session)
                continue
            if session.state == "running" and session.job is job:  # rows came with outputs
                self._stand_for(session, job)
                session.state = "parked"

    def _stand_for(self, session: Session, job: Any) -> None:
        key = session.next_key
        old = self._by_key.get(key)
        if old is not None and old is not session:
            self.close(old)
        session.key, session.next_key = key, None
        if job.stream_request is not None:
            session.engine_request = job.stream_request
        session.job = None
        self._by_key[key] = session
        key.kept = session

    def _forget_key(self, session: Session) -> None:
        key, session.key = session.key, None
        if self._by_key.get(key) is session:
            del self._by_key[key]
        if key.kept is session:
            key.kept = None

    # ---- closing --------------------------------------------------------------------------

    def close(self, session: Session) -> None:
        """Closes one session (aborts its engine request); a closed session is a no-op."""
        if self._sessions.pop(session.request_id, None) is None:
            return
        if session.key is not None:
            self._forget_key(session)
        if session.tag is not None and self._by_tag.get(session.tag) is session:
            del self._by_tag[session.tag]
        self.decisions.pop(session.tag, None)
        session.next_key = None
        session.state = "closed"
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
        """Closes the parked sessions: all but those with a job of ``jobs`` still to run (the
        engine stalled)."""
        in_use = {job.stream_id for job in jobs if job.stream_id and not job.is_done}
        return self.close_where(lambda s: s.request_id not in in_use) > 0

    def _close_idle(self) -> None:
        horizon = self._batch - self.idle_batches
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used >= horizon or oldest.state == "running":
                break
            self.close(oldest)

    def stats(self) -> dict[str, int]:
        return {
            "num_live": len(self._sessions),
            "num_opened": self.num_opened,
            "num_extended": self.num_extended,
            "num_continued": self.num_continued,
            "num_closed": self.num_closed,
        }
