"""Free-running sessions: vLLM draws each session's next token itself, so the engine computes
the row of the extended context while the caller is still looking at the last one.

Held sessions (:mod:`.vllm_sessions`) keep the engine step waiting until the caller's next
token is known. A *free* session instead is one engine request at temperature 1 that vLLM
decodes on its own, with its own sampler: every row the capture processor hands out comes
with the token vLLM drew from that very row (an exact draw from ``softmax(row)``: no
temperature, top-k, top-p, min-p or penalty applies). The row carries that draw (see
:func:`genlm_backend.sampling.offer_draw`); a :class:`~genlm_backend.sampling.TokenSampler`
returns it as the first draw from the row. A request whose context extends the last row's
context by that token takes the session's next row, which the engine computes without
waiting for anybody; with vLLM's async scheduling the host work of one step overlaps the
device's work of the other, as in vLLM's own decode loop.

A request that extends a row's context by any other token (a constrained or resampled
particle) starts a new session over its whole context (vLLM's prefix cache skips most of
the prefill); the old one runs out. Flow control: the engine is stepped while some request
waits for its session's next row, and ``lookahead`` steps more each time it is woken for
them (so the engine computes the rows the callers will ask for next while they look at the
last ones, and then waits for them; see :class:`~.vllm_freedrive.FreeDriver`); a session
whose rows nobody takes while others keep the engine going stops (is aborted) once
``max_ahead`` of them wait, one unused for ``idle_batches`` batches stops, and one whose
request ends at the model's length stops there. At most ``capacity`` sessions run; a new one takes the place of the least recently
used one that nobody waits on, and requests beyond that run as one-row sessions.

A request that extends a session by its draw need not wait for a batch:
:meth:`FreeSessions.take`, on the event loop, hands it the session's next row at once when
the engine has computed it already, or a future of it, which the engine thread resolves with
every other such row of the same step in one call into the loop. Everything else runs on the
model's engine thread, inside or between engine steps; a lock keeps the two threads' views
of a session consistent.

The per-row paths (:meth:`FreeSessions.take`, :meth:`FreeSessions.tokens` and the futures'
resolution) run in C where the optional extension ``_free_kernel`` was built: the same
steps on the same objects (``tests/llm/test_free_kernel.py`` plays random workloads on both
routes and compares them). On the H100 host, inside W1 at N=256, that cut the token tap from
1.14 to 0.90 ms a step (``benchmarks/trace_free.py``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..sampling import offer_draw
from .prompts import LogprobsRequest

__all__ = ["FREE_KEY", "FreeSession", "FreeSessions"]

FREE_KEY = "genlm_free"  # extra_args key of a free session's request: its tag

try:  # the hot paths in C (see _free_kernel.c); without it the methods below run them
    from . import _free_kernel as KERNEL
except ImportError:  # built without a compiler, or not built
    KERNEL = None

_ids = itertools.count()


@dataclass(eq=False, slots=True)
class FreeSession:
    """One free-running engine request."""

    request_id: str
    tag: int
    lora_name: str | None
    rows_left: int  # rows the engine request can still produce (the model's length bounds it)
    captured: collections.deque = field(default_factory=collections.deque)  # rows whose token is not in yet
    ready: collections.deque = field(default_factory=collections.deque)  # (row, token) nobody took yet
    # (batch, index, request, step) that takes the next ready row, since engine step number
    # ``step``; batch None: index is a future of the event loop's, awaited by the request's
    # caller (see FreeSessions.take)
    waiting: Any = None
    key: Any = None  # the request that took (or waits for) the last row handed out
    drawn: int | None = None  # the engine's draw from that row
    last_used: int = 0
    closed: bool = False


class FreeSessions:
    """The free-running sessions of one engine.

    Args:
        start: ``(session, token_ids, lora_name) -> None`` adds the session's engine request
            (its prompt ``token_ids``, ``max_tokens=session.rows_left``, marked with
            ``session.tag``); raises if vLLM refuses it.
        new_tag: ``() -> int``, a fresh capture tag.
        abort: ``(request_ids) -> None`` aborts engine requests (deferred inside a step).
        follow, unfollow: the capture sink's: every final row of a tag goes to a target.
        max_model_len: bounds each session's rows.
        capacity: the most sessions running at once (below ``max_num_seqs``).
        lookahead: engine steps ahead of the requests (see
            :class:`~.vllm_freedrive.FreeDriver`).
        max_ahead: a session with this many rows nobody took stops.
        idle_batches: a session no request extended for this many batches stops.
        use_kernel: run :meth:`take`, :meth:`tokens` and the futures' resolution in C
            where ``_free_kernel`` was built (False: always in Python).
    """

    def __init__(
        self,
        start: Callable[[FreeSession, tuple[int, ...], str | None], None],
        new_tag: Callable[[], int],
        abort: Callable[[list[str]], None],
        follow: Callable[[int, Callable[[torch.Tensor], None]], None],
        unfollow: Callable[[int], None],
        max_model_len: int,
        capacity: int,
        lookahead: int = 1,
        max_ahead: int = 8,
        idle_batches: int = 8,
        use_kernel: bool = True,
    ):
        self._start, self._new_tag, self._abort = start, new_tag, abort
        self._follow, self._unfollow = follow, unfollow
        self.max_model_len = int(max_model_len)
        self.capacity = max(int(capacity), 1)
        self.lookahead = max(int(lookahead), 0)
        self.max_ahead = max(int(max_ahead), self.lookahead + 1)
        self.steps = 0  # engine steps begun (begin_step); a waiting request records the count
        self.idle_batches = max(int(idle_batches), 1)
        self._by_tag: dict[int, FreeSession] = {}
        self.enabled = True  # False: requests still waiting on a stopped session get one-row sessions
        self._batch = 0
        # Guards sessions' state between the engine thread and take() on the event loop.
        self._lock = threading.RLock()
        self._outbox: list[tuple[asyncio.Future, Any]] = []  # results for futures, sent by _send
        self.num_opened = self.num_extended = self.num_missed = self.num_closed = self.num_ahead_stops = 0
        self.num_direct = 0  # requests that took their row without a batch (take)
        self.use_kernel(use_kernel)  # (sets ``kernel`` and ``_resolve``)

    def __len__(self) -> int:
        return len(self._by_tag)

    def use_kernel(self, on: bool) -> bool:
        """Runs :meth:`take`, :meth:`tokens` and the futures' resolution in C where
        ``_free_kernel`` was built (the same steps on the same objects), or in Python;
        returns whether C runs them."""
        kernel = KERNEL if on else None
        self.kernel = kernel is not None
        self._resolve = _resolve if kernel is None else kernel.resolve
        if kernel is None:
            vars(self).pop("take", None)
            vars(self).pop("tokens", None)
        else:
            self.take = functools.partial(kernel.take, FreeSession, self)
            self.tokens = functools.partial(kernel.tokens, self)
        return self.kernel

    @property
    def running(self) -> bool:
        """Some session's engine request still runs (the engine must be stepped)."""
        return bool(self._by_tag)

    def begin_step(self) -> int:
        """Counts an engine step about to run; returns its number."""
        with self._lock:
            self.steps += 1
            return self.steps

    def has_waiting(self, before: int | None = None) -> bool:
        """Some request waits for its session's next row (one that waited already when step
        number ``before`` began, if given)."""
        with self._lock:
            if before is None:
                return any(s.waiting is not None for s in self._by_tag.values())
            return any(s.waiting is not None and s.waiting[3] < before for s in self._by_tag.values())

    def take(self, request: LogprobsRequest) -> torch.Tensor | asyncio.Future | None:
        """On the event loop: for a request that extends a session's context by the session's
        draw, the session's next row (computed already) or a future of it; None for any other
        request (it goes to a batch: :meth:`start_batch`). The caller must then see that the
        engine is stepped for it."""
        parent = request.parent
        session = None if parent is None else parent.kept
        if type(session) is not FreeSession:
            return None
        with self._lock:
            if (session.closed or session.key is not parent or session.waiting is not None or not self.enabled
                    or session.drawn != request.token_ids[-1]):
                return None  # (a miss is counted where the batch opens a new session)
            if session.ready:
                taken = self._next_row(session, request)
            elif session.rows_left > 0:
                taken = asyncio.get_running_loop().create_future()
                session.waiting = (None, taken, request, self.steps)
            else:  # its engine request ended: a batch closes it and opens a new session
                return None
            session.key, session.last_used = request, self._batch
            self.num_extended += 1
            self.num_direct += 1
            return taken

    def start_batch(self, requests: list[LogprobsRequest], batch: Any) -> None:
        """Matches each request to the session whose draw it extends (its row is the
        session's next one) or opens a session for it; rows go to ``batch`` as they come."""
        with self._lock:
            self._batch += 1
            horizon = self._batch - self.idle_batches
            for session in [s for s in self._by_tag.values() if s.last_used < horizon and s.waiting is None]:
                self.close(session)
            opened: list[tuple[int, LogprobsRequest]] = []
            for i, request in enumerate(requests):
                parent = request.parent
                session = None if parent is None else parent.kept
                if type(session) is FreeSession and not session.closed and session.key is parent:
                    if session.rows_left <= 0 and not session.ready and session.waiting is None:
                        self.close(session)  # its engine request ended (its last row was taken directly)
                    elif session.drawn == request.token_ids[-1] and session.waiting is None:
                        session.key, session.last_used = request, self._batch
                        session.waiting = (batch, i, request, self.steps)
                        self.num_extended += 1
                        self._serve(session)
                        continue
                    else:
                        self.num_missed += 1  # another token than the engine's draw: that session is no use now
                opened.append((i, request))
            for i, request in opened:
                self._open(request, batch, i)
        self._send()

    def _open(self, request: LogprobsRequest, batch: Any, i: int) -> None:
        rows = self.max_model_len - len(request.token_ids)
        if not self.enabled or (len(self._by_tag) >= self.capacity and not self._evict()):
            rows = 1  # no room to run on (or turned off): a one-row session, which then stops by itself
        session = FreeSession(f"genlm-free-{next(_ids)}", self._new_tag(), request.lora_name, rows, key=request,
                              waiting=(batch, i, request, self.steps), last_used=self._batch)
        try:
            self._start(session, request.token_ids, request.lora_name)
        except Exception as exc:  # noqa: BLE001 - vLLM refused this request only
            self._give(session.waiting, exc)
            return
        self._by_tag[session.tag] = session
        self._follow(session.tag, session.captured.append)  # (no Python frame a row)
        self.num_opened += 1

    def _evict(self) -> bool:
        """Closes the least recently used session nobody waits on; False when there is none."""
        victim = min((s for s in self._by_tag.values() if s.waiting is None), key=lambda s: s.last_used, default=None)
        if victim is None:
            return False
        self.close(victim)
        return True

    # ---- inside an engine step ------------------------------------------------------------

    def tokens(self, found: list[tuple[Any, Any]]) -> None:
        """The tokens one step sampled, per session tag (the token tap): pairs each with the
        row captured for it, hands rows to their waiting requests, stops sessions too far
        ahead or at their end."""
        with self._lock:
            by_tag, max_ahead = self._by_tag, self.max_ahead
            for tag, tokens in found:
                session = by_tag.get(tag)
                if session is None:
                    continue
                captured, ready = session.captured, session.ready
                for token in tokens:
                    if not captured:  # a token without its row: never seen; not trusted
                        self._fail(session, RuntimeError("a free session's token came without its row"))
                        break
                    ready.append((captured.popleft(), int(token)))
                    session.rows_left -= 1
                if session.closed:
                    continue
                if session.waiting is not None:
                    self._serve(session)
                if session.rows_left <= 0 and not ready:
                    self.close(session)  # its engine request has ended
                elif len(ready) >= max_ahead:
                    self.num_ahead_stops += 1
                    self.close(session)
        self._send()

    def _serve(self, session: FreeSession) -> None:
        waiting = session.waiting
        if waiting is None or not session.ready:
            return
        session.waiting = None
        self._give(waiting, self._next_row(session, waiting[2]))
        if session.rows_left <= 0 and not session.ready:
            self.close(session)

    @staticmethod
    def _next_row(session: FreeSession, request: LogprobsRequest) -> torch.Tensor:
        """Hands ``request`` the session's next ready row, with the engine's draw from it."""
        row, token = session.ready.popleft()
        offer_draw(row, token)
        session.drawn, request.kept = token, session
        return row

    def _give(self, waiting: tuple, result: Any) -> None:
        """Hands a waiting request its row (or error): into its batch, or, for a caller
        awaiting a future, into the outbox that :meth:`_send` empties."""
        batch, slot = waiting[0], waiting[1]
        if batch is None:
            self._outbox.append((slot, result))
        else:
            batch.set(slot, result)

    def _send(self) -> None:
        """Resolves the futures of the outbox: one call into each event loop that awaits them
        (called by every public method of the engine thread's, outside the lock)."""
        if not self._outbox:
            return
        items, self._outbox = self._outbox, []
        by_loop: dict[Any, list] = {}
        for future, result in items:
            by_loop.setdefault(future.get_loop(), []).append((future, result))
        for loop, group in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._resolve, group)
            except RuntimeError:  # the loop was closed: nobody waits any more
                pass

    # ---- closing --------------------------------------------------------------------------

    def close(self, session: FreeSession) -> None:
        """Stops a session (aborts its engine request); a request waiting on it gets a new
        session instead (:meth:`fail_all` fails it). Engine thread, under the lock."""
        if session.closed:
            return
        session.closed = True
        self._by_tag.pop(session.tag, None)
        self._unfollow(session.tag)
        session.captured.clear()
        session.ready.clear()
        self.num_closed += 1
        self._abort([session.request_id])
        waiting, session.waiting = session.waiting, None
        if waiting is not None:  # (its row never comes now) a new session answers it
            self._open(waiting[2], waiting[0], waiting[1])

    def _fail(self, session: FreeSession, exc: BaseException) -> None:
        waiting, session.waiting = session.waiting, None
        self.close(session)
        if waiting is not None:
            self._give(waiting, exc)

    def close_where(self, predicate: Callable[[FreeSession], bool]) -> int:
        """Stops the sessions matching ``predicate`` (requests waiting on them move to new
        sessions); returns how many."""
        with self._lock:
            sessions = [s for s in self._by_tag.values() if predicate(s)]
            for session in sessions:
                self.close(session)
        self._send()
        return len(sessions)

    def close_all(self) -> int:
        return self.close_where(lambda s: True)

    def fail_all(self, make_error: Callable[[], BaseException]) -> int:
        """Stops every session and fails the requests waiting on them (engine failure, shutdown)."""
        with self._lock:
            sessions = list(self._by_tag.values())
            for session in sessions:
                self._fail(session, make_error())
        self._send()
        return len(sessions)

    def stats(self) -> dict[str, int]:
        return {
            "num_live": len(self._by_tag),
            "num_opened": self.num_opened,
            "num_extended": self.num_extended,
            "num_direct": self.num_direct,
            "num_missed": self.num_missed,
            "num_ahead_stops": self.num_ahead_stops,
            "num_closed": self.num_closed,
        }


def _resolve(group: list[tuple[asyncio.Future, Any]]) -> None:
    """On the event loop: the results of directly awaited rows (a cancelled caller's is dropped)."""
    for future, result in group:
        if not future.done():
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
