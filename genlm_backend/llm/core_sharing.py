"""One CPU core for the event loop's thread and the engine thread (``share_core=True``).

With free-running sessions two threads of this process take turns at the GIL every step:
the event loop's (the particles) and the engine thread (vLLM's scheduler, the sessions'
rows and tokens). Both touch the same objects every step: each session, its rows, its
futures, the requests. On two cores each of those objects moves between the cores' caches
twice a step. The GIL lets only one of the threads run at a time anyway, so putting both on
one core costs them no parallelism and keeps those objects in that core's caches. Measured
in W1 at N=256 on the H100 host (``benchmarks/ab_gil_free.py``, variants ``pin_same`` and
``pin_follow``): 1.13 / 1.21 / 1.43 against 1.50 / 1.53 / 1.52 in three calls; moving only
the engine thread after the loop's thread did not help.

:class:`SharedCore` pins each thread that joins to the core the first one ran on, and puts
back the cores each was allowed before when released. A thread keeps what it was given
while pinned: threads it starts then (a thread pool, an OpenMP team) start on that one
core too. Linux only (``os.sched_setaffinity`` on one thread).
"""

from __future__ import annotations

import ctypes
import os
import threading

__all__ = ["SharedCore", "available"]


def available() -> bool:
    """Threads can be pinned one by one here (Linux)."""
    return hasattr(os, "sched_setaffinity") and hasattr(os, "sched_getaffinity")


def _current_cpu() -> int | None:
    try:
        cpu = int(ctypes.CDLL(None).sched_getcpu())
    except (AttributeError, OSError):
        return None
    return cpu if cpu >= 0 else None


class SharedCore:
    """Threads pinned to one core until :meth:`release`; thread-safe."""

    def __init__(self) -> None:
        self.core: int | None = None
        self._before: dict[int, set[int]] = {}  # native thread id -> the cores it had
        self._lock = threading.Lock()

    def __contains__(self, thread_id: int) -> bool:
        return thread_id in self._before

    def join(self) -> None:
        """Pins the calling thread to the shared core (the first thread's current core).
        Where the system refuses (the core left this process's CPU set), the thread stays
        as it is: sharing a core is an optimisation, never a reason for a request to fail."""
        tid = threading.get_native_id()
        if tid in self._before:
            return
        with self._lock:
            try:
                allowed = os.sched_getaffinity(0)  # (Linux: this thread's)
                if self.core is None or self.core not in allowed:
                    here = _current_cpu()
                    self.core = here if here in allowed else min(allowed)
                os.sched_setaffinity(0, {self.core})
            except OSError:
                return
            self._before[tid] = allowed

    def release(self) -> None:
        """Gives every joined thread back the cores it had; a thread that ended is skipped."""
        with self._lock:
            before, self._before = self._before, {}
            self.core = None
        for tid, cores in before.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:  # (ProcessLookupError: the thread has ended)
                pass
