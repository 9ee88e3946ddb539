"""Live engine sessions: a log-probability request that extends the context of an earlier one by a
token costs one decode step of a request that is already running.

A *session* is one vLLM streaming-input request (see
:func:`~genlm_backend.llm.vllm.internals.add_session_chunk`) that stands for the context whose
row it produced last. Its :class:`SessionStatus` is one of:

* ``RUNNING``: a chunk (its first prompt, or tokens appended to a parked session) or a
  continuation is in flight;
* ``HELD``: its row was just captured, inside the engine step that computed it, and the step
  waits (:meth:`~genlm_backend.engine_thread.EngineThread.hold`) for the next batch's plan. A
  request that extends its context by one token *continues* it: that token is forced as the
  session's next token (the capture processor sets every other logit to -inf), so the next step
  computes the new row as a plain decode step, without re-adding the request. A continuation has
  no engine job of its own: the session hands its next row to the request's slot of the batch
  (:meth:`SessionPool.deliver`). Sessions the plan does not continue are parked;
* ``PARKED``: stopped with its KV cache (:func:`~genlm_backend.llm.vllm.internals.park`, or a
  one-token chunk when holding is off); a request that extends it appends a chunk, which re-adds
  the request to the engine's batch once;
* ``CLOSED``: its engine request aborted (for good).

Matching (:meth:`SessionPool.plan`): a request for context ``C`` (adapter ``A``) uses the session
of ``(A, C[:-1])`` when that session is free in this batch; it is found through the request's
``parent`` (the request of ``C[:-1]``, whose ``kept`` is the session standing for it: no hashing
of long contexts), else by value. Particles that share a context after resampling can extend it
only once; the others open new sessions (over the whole context: vLLM's prefix cache still skips
most of the prefill). Requests that find no room run as plain one-shot requests.

Bounds: at most ``capacity`` sessions live (up to ``max_num_seqs``: every session holds a
scheduler slot); a new session takes the place of the least recently used free one; sessions
unused for ``idle_batches`` batches are closed; parked sessions are closed, least recently used
first, where other requests need their slots (:meth:`SessionPool.free_parked`). A chunk or
continuation that fails, is refused or is aborted closes its session; only its own caller sees
the error. Everything here runs on the model's engine thread.
"""

from __future__ import annotations

import enum
import functools
import itertools
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..prompts import LogprobsRequest

__all__ = ["PlanEntry", "Session", "SessionPool", "SessionStatus"]

_ids = itertools.count()


class SessionStatus(enum.Enum):
    """Where a session is (see the module docstring)."""

    RUNNING = "running"
    HELD = "held"
    PARKED = "parked"
    CLOSED = "closed"


RUNNING, HELD, PARKED, CLOSED = SessionStatus  # (module names: the hot path reads them)


@dataclass(eq=False, slots=True)
class Session:
    """One live streaming request: its engine id, adapter, status and the request whose
    context it stands for (``key``; None while running)."""

    request_id: str
    lora_name: str | None
    key: Any = None  # LogprobsRequest
    status: SessionStatus = SessionStatus.RUNNING
    tag: int | None = None  # capture tag of its current chunk (the same for continuations)
    job: Any = None  # the EngineJob of the chunk in flight (None for a continuation)
    next_key: Any = None  # the request in flight
    batch: Any = None  # a continuation's RowBatch, and its slot there
    index: int = 0
    stamp: int = 0  # the last batch that planned it
    last_used: int = 0
    engine_request: Any = None  # the engine request of the last chunk, template of the next
    params: Any = None  # the SamplingParams of its last chunk (continuations reuse them)
    deliver: Callable[[torch.Tensor], None] | None = None  # its capture target (holding on)


@dataclass(slots=True)
class PlanEntry:
    """A request that runs as a chunk appended to a new or parked session (``tokens``: the
    tokens to add)."""

    session: Session
    tokens: tuple[int, ...]


class SessionPool:
    """The live sessions of one engine, keyed by ``(adapter, context)``.

    Args:
        abort: ``(request_ids) -> None``, aborts engine requests (closes their sessions).
        capacity: the most live sessions (0: none, every request is a plain request).
        idle_batches: a session unused for this many batches is closed.
        park: ``(session) -> None``, stops a held session after the current step. Given
            when the engine holds sessions between steps; rows then reach sessions inside
            the step that computes them, through the targets registered with ``follow``.
        follow: ``(tag, target) -> None``, every final row of ``tag`` goes to ``target``.
        unfollow: ``(tag) -> None``, undoes ``follow``.
    """

    def __init__(self, abort: Callable[[list[str]], None], capacity: int, idle_batches: int = 8,
                 park: Callable[[Session], None] | None = None,
                 follow: Callable[[int, Callable[[torch.Tensor], None]], None] | None = None,
                 unfollow: Callable[[int], None] | None = None):
        self._abort = abort
        self._park = park
        self._follow = follow
        self._unfollow = unfollow
        self.capacity = max(int(capacity), 0)
        self.idle_batches = max(int(idle_batches), 1)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._by_key: dict[Any, Session] = {}  # the request a session stands for -> session
        self._held: list[Session] = []  # held in the step being run
        self.decisions: dict[int, int] = {}  # tag -> token forced at the end of this step
        self.decided = False  # a plan has dealt with the held sessions
        self._batch = 0
        self.num_extended = self.num_continued = self.num_opened = self.num_closed = 0
        self.warned_crowded = False  # more contexts than sessions (warned once)
        # Contexts whose session made room for another's -> the batch that closed it.
        self._evicted: dict[LogprobsRequest, int] = {}

    @property
    def holds(self) -> bool:
        """Sessions were held in the step being run (their rows just went out)."""
        return bool(self._held)

    # ---- planning a batch -----------------------------------------------------------------

    def plan(self, requests: Sequence[LogprobsRequest | None],
             batch: Any) -> list[Session | PlanEntry | None]:
        """Per request: the held :class:`Session` it continues (its row goes to ``batch``'s
        slot for it, from the session's next step), a :class:`PlanEntry` (a chunk to add to
        a parked or new session) or None (a plain request; also for a request given as None,
        which does not run).

        Continuations set :attr:`decisions`; held sessions left out are parked. The sessions
        returned are running until their row arrives (:meth:`deliver`) or :meth:`settle`.
        """
        self._batch += 1
        stamp = self._batch
        self._close_idle()
        plan: list[Session | PlanEntry | None] = [None] * len(requests)
        if self.capacity == 0:
            self._park_held()
            return plan
        by_key, sessions, decisions = self._by_key, self._sessions, self.decisions
        evicted = self._evicted
        if evicted:  # forget what was closed idle_batches ago
            evicted = {k: b for k, b in evicted.items() if stamp - b <= self.idle_batches}
            self._evicted = evicted
        num_extended = num_continued = 0
        # More contexts at once than sessions: a request finds no room (below), or extends a
        # context whose session made room for another context a recent batch.
        crowded = False
        for i, request in enumerate(requests):
            if request is None:
                continue
            parent = request.parent
            session = None if parent is None else parent.kept
            if session is None or session.key is not parent:
                context = request.token_ids
                if len(context) < 2:
                    continue
                parent_key = LogprobsRequest(context[:-1], request.lora_name)
                session = by_key.get(parent_key)
                if session is None:
                    crowded = crowded or parent_key in evicted
                    continue
            if session.stamp == stamp or session.status is RUNNING:
                continue  # another request of this batch extends it first
            session.stamp = session.last_used = stamp
            # It stands for ``request``'s context once its row is in.
            key, session.key = session.key, None
            if by_key.pop(key, session) is not session:
                by_key[key] = session  # (another session stands for that context now)
            if key.kept is session:
                key.kept = None
            num_extended += 1
            session.next_key = request
            sessions.move_to_end(session.request_id)
            if session.status is HELD:
                decisions[session.tag] = request.token_ids[-1]
                num_continued += 1
                session.batch, session.index = batch, i
                plan[i] = session
            else:
                plan[i] = PlanEntry(session, request.token_ids[-1:])
            session.status = RUNNING
        self.num_extended += num_extended
        self.num_continued += num_continued
        self._park_held()
        for i, request in enumerate(requests):
            if plan[i] is not None or request is None:
                continue
            if len(sessions) >= self.capacity:
                victim = next((s for s in sessions.values() if s.stamp != stamp), None)
                if victim is None:
                    crowded = True
                    continue  # no room: a plain request
                if victim.key is not None:
                    evicted[victim.key] = stamp
                self.close(victim)
            session = Session(f"genlm-session-{next(_ids)}", request.lora_name, next_key=request,
                              stamp=stamp, last_used=stamp)
            if self._follow is not None:
                session.deliver = functools.partial(self.deliver, session)
            sessions[session.request_id] = session
            self.num_opened += 1
            plan[i] = PlanEntry(session, request.token_ids)
        if crowded and not self.warned_crowded and self.capacity:
            self.warned_crowded = True
            warnings.warn(
                f"more contexts are extended at once than the {self.capacity} live engine sessions "
                "(the engine's max_num_seqs, or `sessions`): they take turns, and sessions are "
                "reopened every step; start the engine with engine_opts={'max_num_seqs': N} for N "
                "at least the number of contexts (particles) a step", RuntimeWarning, stacklevel=1)
        return plan

    def bind(self, entry: PlanEntry, job: Any, tag: int) -> None:
        """Records the job (and its capture tag) that runs ``entry``'s chunk."""
        session = entry.session
        if session.tag != tag:
            if session.tag is not None and self._unfollow is not None:
                self._unfollow(session.tag)
            session.tag = tag
            if session.deliver is not None:
                self._follow(tag, session.deliver)
        session.job = job
        session.params = job.params

    # ---- inside an engine step ------------------------------------------------------------

    def deliver(self, session: Session, row: torch.Tensor) -> None:
        """The final row of ``session``'s chunk or continuation, inside the step that computed
        it: hands it to its request, and holds the session, which now stands for that
        request's context. A row nobody waits for any more (its job failed) closes it."""
        if session.status is not RUNNING:
            return
        job = session.job
        if job is None:  # a continuation (the hot path of lockstep sampling)
            batch = session.batch
            if batch is None:
                self.close(session)
                return
            session.batch = None
            batch.set(session.index, row)
        else:  # a chunk
            session.job = None
            job.finish(row)
            if job.result is not row:
                self.close(session)
                return
            if job.stream_request is not None:
                session.engine_request = job.stream_request
        key = session.next_key  # _stand_for, inlined
        old = self._by_key.setdefault(key, session)
        if old is not session:
            self._stand_for(session)
        else:
            session.key, session.next_key = key, None
            key.kept = session
        session.status = HELD
        self._held.append(session)

    def release(self) -> dict[int, int]:
        """Ends this step's hold: parks the held sessions no plan continued; returns (and
        forgets) the tokens to force."""
        self._park_held()
        decisions, self.decisions = self.decisions, {}
        self.decided = False
        return decisions

    def _park_held(self) -> None:
        for session in self._held:
            if session.status is not HELD:  # continued (running) or closed
                continue
            if self._park is None:
                self.close(session)
            else:
                self._park(session)
                if session.status is not CLOSED:  # (a park that fails closes the session)
                    session.status = PARKED
        self._held = []
        self.decided = True

    # ---- after a batch --------------------------------------------------------------------

    def settle(self, requests: Sequence[Any], plan: Sequence[Any], jobs: Sequence[Any],
               results: Sequence[Any]) -> None:
        """After a batch: sessions whose request failed (or was retried as a plain request)
        are closed; a chunk whose row came with its output (no holding) parks its session.
        ``jobs`` and ``results`` are aligned with ``requests`` (no job for a continuation)."""
        for request, entry, job, result in zip(requests, plan, jobs, results):
            if entry is None:
                continue
            if type(entry) is Session:  # a continuation: its row went to ``results``
                if not isinstance(result, torch.Tensor) and entry.next_key is request:
                    self.close(entry)
                continue
            session = entry.session
            ok = isinstance(job.result, torch.Tensor) and job.stream_id == session.request_id
            if not ok:
                if session.job is job:
                    self.close(session)
                continue
            if session.status is RUNNING and session.job is job:  # rows came with outputs
                session.job = None
                if job.stream_request is not None:
                    session.engine_request = job.stream_request
                self._stand_for(session)
                session.status = PARKED

    def _stand_for(self, session: Session) -> None:
        key = session.next_key
        old = self._by_key.setdefault(key, session)
        if old is not session:  # another session stood for this context: one is enough
            self.close(old)
            self._by_key[key] = session
        session.key, session.next_key = key, None
        key.kept = session

    def _forget_key(self, session: Session) -> None:
        key, session.key = session.key, None
        if key is None:
            return
        if self._by_key.get(key) is session:
            del self._by_key[key]
        if key.kept is session:
            key.kept = None

    # ---- closing --------------------------------------------------------------------------

    def close(self, session: Session) -> None:
        """Closes one session (aborts its engine request); a closed session is a no-op."""
        if self._sessions.pop(session.request_id, None) is None:
            return
        self._forget_key(session)
        if session.tag is not None:
            if session.deliver is not None:
                self._unfollow(session.tag)
            self.decisions.pop(session.tag, None)
        # ``deliver`` holds the session: without it the session is freed by reference
        # counting, not left to the cycle collector (which holds the GIL while it runs).
        session.next_key = session.job = session.batch = session.deliver = None
        session.status = CLOSED
        self.num_closed += 1
        self._abort([session.request_id])

    def get(self, request_id: str) -> Session | None:
        return self._sessions.get(request_id)

    def resize(self, capacity: int) -> None:
        """Sets the capacity; closes the least recently used sessions beyond it."""
        self.capacity = max(int(capacity), 0)
        while len(self._sessions) > self.capacity:
            self.close(next(iter(self._sessions.values())))

    def close_where(self, predicate: Callable[[Session], bool], limit: int | None = None) -> int:
        """Closes the sessions matching ``predicate``, least recently used first, at most
        ``limit`` of them (None: all); returns how many."""
        victims = [s for s in self._sessions.values() if predicate(s)][:limit]
        for session in victims:
            self.close(session)
        return len(victims)

    def close_all(self) -> int:
        return self.close_where(lambda s: True)

    def free_parked(self, jobs: Sequence[Any], limit: int | None = None) -> bool:
        """Closes parked sessions, least recently used first, at most ``limit`` (None: all),
        but not those with a job of ``jobs`` still to run; returns whether any was closed."""
        in_use = {job.stream_id for job in jobs if job.stream_id and not job.is_done}
        return self.close_where(
            lambda s: s.status is PARKED and s.request_id not in in_use, limit) > 0

    def _close_idle(self) -> None:
        horizon = self._batch - self.idle_batches
        while self._sessions:
            oldest = next(iter(self._sessions.values()))
            if oldest.last_used >= horizon or oldest.status is RUNNING:
                break
            self.close(oldest)

    def stats(self) -> dict[str, int]:
        return {"num_live": len(self._sessions), "num_opened": self.num_opened,
                "num_extended": self.num_extended, "num_continued": self.num_continued,
                "num_closed": self.num_closed}
