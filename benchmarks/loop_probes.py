"""What keeps an event loop from running, measured from inside the process.

Used by ``bench_heartbeat.py``: :class:`Heartbeat` (how late 1 ms sleeps on the loop wake,
with the loop thread's CPU time and its wait for a core in each), :class:`GCPauses` (the
cyclic collector's runs), :class:`CallbackTimer` (the loop's callbacks that used the most
CPU) and :class:`StackSampler` (every thread's stack while the loop is late).
"""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing_extensions import Self

BEAT_S = 0.001


class Heartbeat:
    """Lateness of 1 ms sleeps on the loop, with the loop thread's CPU time in each beat and,
    on Linux, the time it waited for a core (``/proc/.../schedstat``: runnable, not run), and
    the longest such wait of any thread of this process in the beat (a thread that holds the
    GIL while it waits for a core keeps the loop waiting too)."""

    def __init__(self) -> None:
        self.late_s: list[float] = []
        self.cpu_s: list[float] = []
        self.runq_s: list[float] = []
        self.any_runq_s: list[float] = []
        self.last_beat = time.perf_counter()
        self.running = True

    async def run(self) -> None:
        loop_thread, runqueue_waits = threading.get_native_id(), _RunqueueWaits()
        waits = runqueue_waits()
        try:
            while self.running:
                start, cpu = time.perf_counter(), time.thread_time()
                await asyncio.sleep(BEAT_S)
                self.last_beat = now = time.perf_counter()
                self.late_s.append(max(0.0, now - start - BEAT_S))
                self.cpu_s.append(time.thread_time() - cpu)
                after = runqueue_waits()  # (read once a beat: the next beat starts from it)
                grew = [after[t] - waits[t] for t in after.keys() & waits.keys()]
                self.runq_s.append(after.get(loop_thread, 0.0) - waits.get(loop_thread, 0.0))
                self.any_runq_s.append(max(grew, default=0.0))
                waits = after
        finally:
            runqueue_waits.close()


class _RunqueueWaits:
    """Seconds each thread of this process has spent runnable but waiting for a core, by
    native thread id (empty where ``/proc`` does not tell); threads are listed again every
    ``relist`` calls, and each one's file is kept open (a read is then about 2 us)."""

    def __init__(self, relist: int = 50) -> None:
        self.relist, self.calls = relist, 0
        self.files: dict[int, int] = {}

    def __call__(self) -> dict[int, float]:
        if self.calls % self.relist == 0:
            self._list()
        self.calls += 1
        waits = {}
        for tid, fd in list(self.files.items()):
            try:
                waits[tid] = int(os.pread(fd, 64, 0).split()[1]) / 1e9
            except OSError:  # the thread ended
                os.close(self.files.pop(tid))
        return waits

    def _list(self) -> None:
        try:
            tids = {int(tid) for tid in os.listdir("/proc/self/task")}
        except OSError:
            return
        for tid in tids - self.files.keys():
            try:
                self.files[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                pass

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()


class GCPauses:
    """Durations of the cyclic garbage collector's runs while installed (wall, and CPU time
    of the thread that collected: the collector holds the GIL throughout)."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self.cpu_s: list[float] = []
        self.num_full = 0  # collections of the oldest generation
        self._start = self._cpu = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start, self._cpu = time.perf_counter(), time.thread_time()
        else:
            self.pauses_s.append(time.perf_counter() - self._start)
            self.cpu_s.append(time.thread_time() - self._cpu)
            self.num_full += info["generation"] == 2


class CallbackTimer:
    """The loop thread's CPU time in each callback the loop runs (task steps included),
    while installed: the callbacks that ran longest, whatever the machine's load (a thread's
    CPU time does not count the time it waits for a core or for the GIL)."""

    def __init__(self, keep: int = 12) -> None:
        self.keep = keep
        self.slowest: list[tuple[float, float, str]] = []  # (cpu_s, wall_s, what)
        self.total_cpu_s = 0.0
        self.num_callbacks = 0
        self._run = asyncio.events.Handle._run

    def __enter__(self) -> Self:
        timer, run = self, self._run

        def timed_run(handle: asyncio.Handle) -> None:
            where = _resumes_at(handle)
            cpu, wall = time.thread_time(), time.perf_counter()
            try:
                run(handle)
            finally:
                timer.record(handle, time.thread_time() - cpu, time.perf_counter() - wall, where)

        asyncio.events.Handle._run = timed_run
        return self

    def __exit__(self, *exc_info: object) -> None:
        asyncio.events.Handle._run = self._run

    def record(self, handle: asyncio.Handle, cpu_s: float, wall_s: float, where: str) -> None:
        self.total_cpu_s += cpu_s
        self.num_callbacks += 1
        if len(self.slowest) < self.keep or cpu_s > self.slowest[-1][0]:
            self.slowest.append((cpu_s, wall_s, _callback_name(handle) + where))
            self.slowest.sort(key=lambda row: -row[0])
            del self.slowest[self.keep :]


def _resumes_at(handle: asyncio.Handle) -> str:
    """Where a task's step resumes its coroutine (the innermost suspended frame)."""
    owner = getattr(getattr(handle, "_callback", None), "__self__", None)
    if not isinstance(owner, asyncio.Task):
        return ""
    coro, frame = owner.get_coro(), None
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        frame, coro = coro.cr_frame, coro.cr_await
    if frame is None:
        return ""
    return f" (resumes at {Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


def _callback_name(handle: asyncio.Handle) -> str:
    callback = getattr(handle, "_callback", None)
    owner = getattr(callback, "__self__", None)
    if isinstance(owner, asyncio.Task):  # a task's step: name the coroutine
        coro = owner.get_coro()
        return f"task {getattr(coro, '__qualname__', type(coro).__qualname__)}"
    return f"{getattr(callback, '__qualname__', repr(callback))}"


class StackSampler(threading.Thread):
    """While the heartbeat is more than ``late_s`` late, samples the stack of every other
    thread: the loop's (what runs on it) and the rest (who holds the GIL meanwhile)."""

    def __init__(self, heart: Heartbeat, loop_thread: int, late_s: float):
        super().__init__(daemon=True, name="heartbeat-sampler")
        self.heart, self.loop_thread, self.late_s = heart, loop_thread, late_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.stopped = threading.Event()

    def run(self) -> None:
        names = {}
        while not self.stopped.wait(0.002):
            if time.perf_counter() - self.heart.last_beat <= self.late_s:
                continue
            for ident, frame in sys._current_frames().items():
                if ident == self.ident:
                    continue
                if ident not in names:
                    names[ident] = "loop" if ident == self.loop_thread else _thread_name(ident)
                self.counts[f"[{names[ident]}] {_describe(traceback.extract_stack(frame))}"] += 1


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


def _describe(stack: traceback.StackSummary) -> str:
    """The innermost frames of the package, or of anything where it has none, innermost last."""
    ours = [
        f for f in stack if "genlm_backend" in f.filename and "bench_heartbeat" not in f.filename
    ]
    frames = [*ours[-2:], *(f for f in stack[-2:] if f not in ours[-2:])]
    return " > ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)
