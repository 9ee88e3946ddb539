"""Where one lockstep step of W1 goes on AsyncVirtualLM: a timeline of its hand-offs.

Wraps the points a step passes through (the capture inside the engine step, the rows
reaching the event loop, the user's draw, the next batch reaching the engine thread, its
plan, the end of the hold, the rest of the engine step) with timestamps, runs W1 (or W5) of
``bench_smc_vllm.py`` with its flags, and prints the median time between consecutive points
per step, next to vLLM's own decode loop on the same engine. The wrappers add a few
microseconds per point, so read differences, not absolutes.

    python benchmarks/diagnostics/trace_w1.py --gpu --tokenizer-dir DIR --particles 1 8 64
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/diagnostics/trace_w1.py --micro --particles 8
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.diagnostics._w1 import UserSampler, parse, run_floor, run_ours, start

EVENTS: list[tuple[str, int, bool]] = []  # (point, ns, on the engine thread)
_LOOP_THREAD = threading.main_thread()


def mark(point: str) -> None:
    EVENTS.append((point, time.perf_counter_ns(), threading.current_thread() is not _LOOP_THREAD))


def wrap(owner: object, name: str, before: str | None, after: str | None) -> None:
    original = getattr(owner, name)
    if asyncio.iscoroutinefunction(original):
        @functools.wraps(original)
        async def traced(*args, **kwargs):
            if before:
                mark(before)
            try:
                return await original(*args, **kwargs)
            finally:
                if after:
                    mark(after)
    else:
        @functools.wraps(original)
        def traced(*args, **kwargs):
            if before:
                mark(before)
            try:
                return original(*args, **kwargs)
            finally:
                if after:
                    mark(after)
    setattr(owner, name, traced)


def install() -> None:
    from genlm_backend import _batch_queue
    from genlm_backend._engine_thread import EngineThread
    from genlm_backend.llm import base, vllm
    from genlm_backend.llm.vllm import capture as vllm_capture
    from genlm_backend.llm.vllm import engine as vllm_engine
    from genlm_backend.llm.vllm import sessions as vllm_sessions

    wrap(vllm_capture.LogprobsCaptureProcessor, "apply", "apply", "apply_end")
    wrap(vllm_capture.CaptureSink, "capture", None, "rows_out")
    wrap(vllm_engine, "_resolve", "rows_on_loop", None)
    wrap(UserSampler, "step", "draw", "draw_end")
    wrap(vllm.AsyncVirtualLM, "_evaluate_logprobs", "batch_in", None)
    wrap(vllm.AsyncVirtualLM, "_start_batch", "plan", "plan_end")
    wrap(EngineThread, "hold", None, "hold_end")
    wrap(EngineThread, "submit_hold_safe", "to_engine", None)
    wrap(vllm_sessions.SessionPool, "plan", None, "sessions_planned")
    wrap(vllm.AsyncVirtualLM, "_on_step", "on_step", None)
    wrap(_batch_queue.LoopQueue, "start", "batch_start", None)
    wrap(_batch_queue.LoopQueue, "finish", "resolve", "resolved")
    wrap(base.AsyncLM, "next_token_logprobs", "request", None)


def install_engine(engine: object) -> None:
    """Points inside vLLM's step, where this version has them (ours and the floor alike)."""
    from genlm_backend.llm.vllm import internals

    wrap(engine, "step", "step", "step_end")
    core = getattr(engine.engine_core, "engine_core", None)
    runner = internals.engine._model_runner(engine)
    for owner, name in ((getattr(core, "scheduler", None), "schedule"), (runner, "execute_model"),
                        (runner, "sample_tokens"), (getattr(runner, "sampler", None), "forward"),
                        (runner, "_bookkeeping_sync"), (getattr(core, "scheduler", None), "update_from_output"),
                        (engine.output_processor, "process_outputs")):
        if owner is not None and hasattr(owner, name):
            wrap(owner, name, name, f"{name}_end")


def step_intervals(events: list[tuple[str, int, bool]]) -> dict[str, float]:
    """Median microseconds between consecutive points, over steps (a step starts at ``apply``)."""
    gaps: dict[str, list[float]] = {}
    previous = None
    for point, ns, _ in events:
        if previous is not None:
            key = f"{previous[0]} -> {point}"
            gaps.setdefault(key, []).append((ns - previous[1]) / 1e3)
        previous = (point, ns)
    return {k: statistics.median(v) for k, v in gaps.items() if len(v) >= 8}


def main() -> None:
    args = parse(sys.argv[1:])
    lm, prompt = start(args, install)  # installed before the model: its batchers keep what they are given
    install_engine(lm.llm.llm_engine)
    for workload in args.workloads:
        for n in args.particles:
            run_ours(lm, prompt, n, args, workload)  # warm-up
            ours, floors = [], []
            for _ in range(args.repeats):
                EVENTS.clear()
                start_s = time.perf_counter()
                run_ours(lm, prompt, n, args, workload)
                ours.append(time.perf_counter() - start_s)
                run_events = list(EVENTS)
                EVENTS.clear()
                start_s = time.perf_counter()
                run_floor(lm, prompt, n, args)
                floors.append(time.perf_counter() - start_s)
            floor_events = list(EVENTS)
            steps = [ns for point, ns, _ in floor_events if point == "step"]
            floor_step = statistics.median((b - a) / 1e3 for a, b in zip(steps, steps[1:]))
            print(f"\n{workload} N={n}: ours {statistics.median(ours) * 1e3:.1f} ms, floor "
                  f"{statistics.median(floors) * 1e3:.1f} ms, ratio {statistics.median(ours) / statistics.median(floors):.3f}; "
                  f"floor step {floor_step:.0f} us")
            starts = [ns for point, ns, _ in run_events if point == "apply"]
            print(f"  our step (apply to apply): {statistics.median((b - a) / 1e3 for a, b in zip(starts, starts[1:])):.0f} us")
            for key, us in step_intervals(run_events).items():
                print(f"  {us:9.1f} us  {key}")
            print("  the floor:")
            for key, us in step_intervals(floor_events).items():
                print(f"  {us:9.1f} us  {key}")
    lm.cleanup()


if __name__ == "__main__":
    main()
