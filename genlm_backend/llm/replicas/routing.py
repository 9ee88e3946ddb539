"""Which replica evaluates each request of a batch: lineage first, then balance.

A lockstep sampler's request for a context ``C`` usually extends by one token a context
``C[:-1]`` that it sent a step before (``request.parent``, from :mod:`..prompts`). The
replica that evaluated ``C[:-1]`` holds what makes ``C`` cheap: ``C[:-1]``'s KV blocks in its
prefix cache and, for the vLLM backend, the engine session standing for ``C[:-1]``, which
``C`` continues with a one-token decode step. Particles that share a context after
resampling (its children) find that replica the same way. Elsewhere ``C`` would be prefilled
from scratch.

:meth:`Router.route` decides, for one batch of ``n`` distinct requests over ``k`` replicas:

1. *Lineage*: a request whose own context, or whose parent's, was routed recently goes to
   the same replica. Routes are remembered by request hash (prompt and adapter) in two
   generations of ``remember`` entries each (plain ints: nothing is kept alive); a hash
   collision can only misplace a request, never change its row.
2. *Balance*: a replica that would get more than ``ceil(n / k * margin)`` requests gives up
   its excess over an even share, ``ceil(n / k)``, one request at a time, to the least
   loaded replica: first the children of a context that another request of the batch
   extends already (*siblings*: only one request can continue a context's session, the
   others open new sessions anyway), then the latest of the others. The default margin,
   1.0, keeps every batch even: a batch takes as long as its largest share, and a moved
   request costs little where particles share their prompt (only the tokens after the
   prompt's cached blocks are prefilled again). With 1.25, the first split of a sampler's
   particles from one prompt stayed at 62/38 for good (CPU, 16 particles on 2 replicas),
   which caps the speedup of 2 replicas at 1.6x.
3. *New contexts* (no known route) go, in batch order, to the least loaded replica (ties:
   the lowest index).

Every request's replica is then remembered as its route, so its children follow it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["Router"]


class Router:
    """Routes batches of requests to ``num_replicas`` replicas (see the module docstring).

    Args:
        num_replicas: k, the number of replicas.
        margin: a replica that would get more than ``ceil(n / k * margin)`` of a batch's ``n``
            requests gives up all it has beyond ``ceil(n / k)`` (>= 1.0).
        remember: routes are remembered for between ``remember`` and ``2 * remember`` later
            requests.

    Attributes:
        num_routed: requests routed.
        num_kept: requests sent where their context or their parent's went (lineage kept).
        num_moved: requests moved off their lineage's replica for balance.
        num_new: requests without a known route, sent to the least loaded replica.
        num_rows: per replica, the requests it was sent.
    """

    def __init__(self, num_replicas: int, margin: float = 1.0, remember: int = 4096):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not margin >= 1.0:
            raise ValueError(f"margin must be >= 1.0, got {margin!r}")
        self.num_replicas = num_replicas
        self.margin = float(margin)
        self.remember = max(int(remember), 1)
        self._new: dict[int, int] = {}  # request hash -> replica, newest generation
        self._old: dict[int, int] = {}
        self.num_routed = self.num_kept = self.num_moved = self.num_new = 0
        self.num_rows = [0] * num_replicas

    def limits(self, n: int) -> tuple[int, int]:
        """For a batch of ``n``: the most requests one replica keeps without giving any up,
        and the even share it gives its excess down to."""
        even = math.ceil(n / self.num_replicas)
        return max(math.ceil(n * self.margin / self.num_replicas), even), even

    def route(self, requests: Sequence[Any]) -> list[int]:
        """The replica index of each request (``LogprobsRequest``-like: hashable, with a
        ``parent`` attribute), in order; remembers them as routes."""
        k, n = self.num_replicas, len(requests)
        new, old = self._new, self._old
        choice = [0] * n
        load = [0] * k
        if k == 1:  # nothing to decide: only num_routed and num_rows count
            load[0] = n
            self._count(n, 0, 0, 0, load)
            return choice
        keeps: list[list[int]] = [[] for _ in range(k)]  # lineage kept, in batch order
        siblings: list[list[int]] = [[] for _ in range(k)]  # later children of one parent
        extended: set[int] = set()  # parents a request of this batch extends
        fresh: list[int] = []
        for i, request in enumerate(requests):
            own = hash(request)
            replica = new.get(own)
            if replica is None:
                replica = old.get(own)
            is_sibling = False
            if replica is None:
                parent = request.parent
                if parent is not None:
                    key = hash(parent)
                    replica = new.get(key)
                    if replica is None:
                        replica = old.get(key)
                    if replica is not None:
                        is_sibling = key in extended
                        extended.add(key)
            if replica is None or replica >= k:
                fresh.append(i)
                continue
            choice[i] = replica
            load[replica] += 1
            (siblings if is_sibling else keeps)[replica].append(i)
        num_kept = n - len(fresh)
        num_moved = 0
        most, even = self.limits(n)
        for replica in range(k):
            if load[replica] <= most:
                continue
            excess = load[replica] - even
            movable = siblings[replica] + keeps[replica][::-1]
            for i in movable[:excess]:
                target = min(range(k), key=load.__getitem__)
                choice[i] = target
                load[replica] -= 1
                load[target] += 1
            num_moved += excess
        for i in fresh:
            target = min(range(k), key=load.__getitem__)
            choice[i] = target
            load[target] += 1
        self._remember(requests, choice)
        self._count(n, num_kept - num_moved, num_moved, len(fresh), load)
        return choice

    def forget(self) -> None:
        """Drops every remembered route."""
        self._new, self._old = {}, {}

    def stats(self) -> dict[str, Any]:
        """The counters (see the class's attributes), as a dict."""
        return {
            "num_routed": self.num_routed,
            "num_kept": self.num_kept,
            "num_moved": self.num_moved,
            "num_new": self.num_new,
            "num_rows": list(self.num_rows),
        }

    def _remember(self, requests: Sequence[Any], choice: list[int]) -> None:
        new = self._new
        for request, replica in zip(requests, choice):
            new[hash(request)] = replica
        if len(new) >= self.remember:
            self._old, self._new = new, {}

    def _count(self, n: int, kept: int, moved: int, fresh: int, load: list[int]) -> None:
        self.num_routed += n
        self.num_kept += kept
        self.num_moved += moved
        self.num_new += fresh
        for replica, count in enumerate(load):
            self.num_rows[replica] += count
