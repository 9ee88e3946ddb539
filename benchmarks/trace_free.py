"""Where the host time of a W1 step goes with free-running sessions, thread by thread.

With free sessions the engine thread steps vLLM while the event loop runs the particles, so
a timeline of hand-offs (``trace_w1.py``) says little: the two threads overlap, and what
decides the step is how much each one has to do, and whether both fit in the device's
time. This runs W1 (``--sessions free``) and vLLM's decode loop (the floor) on one engine
and prints, per engine step, in microseconds:

* ``wall``: the run's wall time over its steps;
* ``loop_cpu`` and ``engine_cpu``: CPU time of the event loop's thread and of the engine
  thread (the two share the GIL: their sum above ``wall`` means they overlap in C code or on
  the device, their sum near ``wall`` means they take turns);
* the time inside each wrapped point (inclusive wall time on the thread that ran it):
  vLLM's ``step`` and its parts (``schedule``, ``execute_model``, ``sample_tokens``,
  ``update_from_output``, ``process_outputs``), the capture processor's ``apply``, the token
  tap's ``tokens``, the start of a batch (``start_batch``), the prompt checks
  (``request``, on the loop), requests taking their rows without a batch (``take``, on the
  loop), the particles' draws (``draw``)
  and the rows reaching the loop (``rows_to_loop``);
* ``loop_idle``: the loop's time waiting in its selector (nothing to run), and
  ``engine_idle``: the engine thread's time waiting for a task.

With the model runner in a worker process (``--engine-opt distributed_executor_backend=mp``)
two more points show: the rows of a step reaching their sessions (``rows``), with their copy
out of the row ring (``ring_read``).

With ``--cpu`` the points take the CPU time of the thread that ran them instead of wall
time (``time.thread_time``): what each part costs the host, without the time it spent
waiting for the GIL or the device. The idle points stay wall time, and coroutines (the
particles' ``draw``) are left out: their thread runs other coroutines while one awaits.

``ours`` runs the sessions' hot paths (take, tokens, the futures' resolution) in C where
``_free_kernel`` was built, and the prompt checks' extension step in C where
``_prompt_kernel`` was; ``python`` is the same run with both in Python, alternated with the
others (its column is left out without the free-session kernel).

The wrappers cost ~1 us a call (a little more with ``--cpu``): read differences between
ours and the floor, not absolutes.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/trace_free.py --gpu --tokenizer-dir DIR \\
        --engine-opt async_scheduling=true --particles 8 64 256 \\
        [--engine-opt distributed_executor_backend=mp] [--cpu]
"""

from __future__ import annotations

import asyncio
import collections
import functools
import selectors
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import decode_loop, lockstep_smc, model_for, parse_args, parse_opts  # noqa: E402

TOTALS: collections.Counter = collections.Counter()  # point -> seconds
CALLS: collections.Counter = collections.Counter()  # point -> calls
CLOCK = [time.perf_counter]  # what the points measure: wall time, or the thread's CPU time (--cpu)


def wrap(owner: object, name: str, point: str, clock: Any = None) -> None:
    """Adds the time of every call of ``owner.name`` (inclusive) to ``TOTALS[point]``: wall
    time, or the calling thread's CPU time under ``--cpu`` (``clock``: this one instead)."""
    clock = clock or CLOCK[0]
    original = getattr(owner, name, None)
    if original is None:
        return
    if asyncio.iscoroutinefunction(original):
        if clock is time.thread_time:  # the thread runs other coroutines while one awaits
            return
        @functools.wraps(original)
        async def timed(*args, **kwargs):
            start = clock()
            try:
                return await original(*args, **kwargs)
            finally:
                TOTALS[point] += clock() - start
                CALLS[point] += 1
    else:
        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = clock()
            try:
                return original(*args, **kwargs)
            finally:
                TOTALS[point] += clock() - start
                CALLS[point] += 1
    setattr(owner, name, timed)


def install_backend() -> None:
    """Points of ours; before the model is built (its batchers keep the methods they are given)."""
    from genlm_backend import _batch_queue, sampling
    from genlm_backend.llm import prompts, row_ring, vllm_capture, vllm_freedrive, vllm_freerun

    wrap(vllm_capture.LogprobsCaptureProcessor, "apply", "apply")
    wrap(vllm_freerun.FreeSessions, "tokens", "tokens")
    wrap(vllm_freerun.FreeSessions, "take", "take")
    wrap(prompts.PromptChecker, "request", "request")
    if vllm_freerun.KERNEL is not None:  # (FreeSessions.use_kernel binds them when the model is built)
        wrap(vllm_freerun.KERNEL, "tokens", "tokens")
        wrap(vllm_freerun.KERNEL, "take", "take")
    wrap(vllm_freedrive.FreeDriver, "_start_batch", "start_batch")
    wrap(sampling.TokenSampler, "sample", "draw")
    wrap(_batch_queue.LoopQueue, "finish", "rows_to_loop")
    wrap(vllm_capture, "deliver_remote", "rows")  # (handed to the engine when it is made)
    wrap(row_ring.RowRing, "read", "ring_read")
    wrap(selectors.EpollSelector, "select", "loop_idle", clock=time.perf_counter)


def install_engine(engine: object) -> None:
    """Points inside vLLM's step (ours and the floor's alike), after our own hooks went in."""
    from genlm_backend.llm import vllm_internals

    wrap(engine, "step", "step")
    scheduler = vllm_internals._scheduler(engine)
    runner = vllm_internals._model_runner(engine)
    for owner, name in ((scheduler, "schedule"), (runner, "execute_model"), (runner, "sample_tokens"),
                        (scheduler, "update_from_output"), (engine.output_processor, "process_outputs")):
        if owner is not None:
            wrap(owner, name, name)


class TimedLock:
    """A stand-in for the engine thread's wake-up lock that adds its waits to ``engine_idle``."""

    def __init__(self, lock: threading.Lock):
        self._lock = lock

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        start = time.perf_counter()
        try:
            return self._lock.acquire(blocking, timeout)
        finally:
            TOTALS["engine_idle"] += time.perf_counter() - start

    def release(self) -> None:
        self._lock.release()


def thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def measure(lm, fn, thread: threading.Thread, steps: int) -> dict[str, float]:
    """Runs ``fn`` once; microseconds per engine step of each figure."""
    TOTALS.clear()
    CALLS.clear()
    loop_cpu, engine_cpu = time.thread_time(), thread_cpu(thread)
    start = time.perf_counter()
    fn()
    wall = time.perf_counter() - start
    figures = {"wall": wall, "loop_cpu": time.thread_time() - loop_cpu, "engine_cpu": thread_cpu(thread) - engine_cpu,
               **TOTALS}
    figures = {k: 1e6 * v / steps for k, v in figures.items()}
    figures["engine_steps"] = CALLS["step"] / steps
    return figures


def main() -> None:
    if "--cpu" in sys.argv:
        CLOCK[0] = time.thread_time
    args = parse_args([a for a in sys.argv[1:] if a != "--cpu"] + ["--sessions", "free"])
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts = model_for(args)
    opts.update(parse_opts(args.engine_opt))
    install_backend()
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts={**opts, "seed": 0}, batch_size=max(args.particles),
                                  session_lookahead=args.session_lookahead)
    lm.set_sessions("free")
    llm = lm.underlying_model
    install_engine(llm.llm_engine)
    thread = lm._engine_thread._thread
    lm._engine_thread._wakeup = TimedLock(lm._engine_thread._wakeup)
    prompt = [100 + i % (lm.vocab_size - 100) for i in range(args.prompt_len)]
    sampler = args.sampler

    from genlm_backend.llm import prompts

    sessions, prompt_kernel = lm._free.sessions, prompts.KERNEL
    kernel = sessions.kernel

    def ours(n: int, use_kernel: bool = True):
        def run() -> None:
            sessions.use_kernel(use_kernel)
            prompts.KERNEL = prompt_kernel if use_kernel else None
            try:
                asyncio.run(lockstep_smc(lm, prompt, n, args.steps, 0, sampler))
                lm.close_sessions()
            finally:
                sessions.use_kernel(True)
                prompts.KERNEL = prompt_kernel
        return run

    def floor(n: int):
        return lambda: lm._engine_thread.submit(decode_loop, llm, prompt, n, args.steps).result()

    variants = {"ours": ours, "floor": floor}
    if kernel:
        variants = {"ours": ours, "python": lambda n: ours(n, use_kernel=False), "floor": floor}
    for n in args.particles:
        results: dict[str, list[dict]] = {name: [] for name in variants}
        for make in variants.values():
            make(n)()  # warm-up
        for _ in range(args.repeats):
            for name, make in variants.items():
                results[name].append(measure(lm, make(n), thread, args.steps))
        keys = list(dict.fromkeys(k for runs in results.values() for r in runs for k in r))
        print(f"\nN={n}, T={args.steps}: microseconds per step (median of {args.repeats})")
        print(f"  {'':20s} " + " ".join(f"{name:>9s}" for name in variants))
        for key in keys:
            values = [statistics.median(r.get(key, 0.0) for r in results[name]) for name in variants]
            print(f"  {key:20s} " + " ".join(f"{v:9.1f}" for v in values))
        sys.stdout.flush()
    lm.cleanup()


if __name__ == "__main__":
    main()
