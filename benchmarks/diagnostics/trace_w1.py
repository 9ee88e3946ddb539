"""Where one lockstep step of W1 goes on AsyncVirtualLM: a timeline of its hand-offs.

Wraps the points a step passes through (the capture inside the engine step, the rows
reaching the event loop, the user's draw, the next batch reaching the engine thread, its
plan, the end of the hold, the rest of the engine step) with timestamps, runs W1 (or W5) of
``bench_smc_vllm.py`` with its flags, and prints the median time between consecutive points
per step, next to vLLM's own decode loop on the same engine. The wrappers add a few
microseconds per point, so read differences, not absolutes.

    python benchmarks/diagnostics/trace_w1.py --gpu --tokenizer-dir DIR --particles 1 8 64
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/diagnostics/trace_w1.py \\
        --micro --particles 8
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.diagnostics._w1 import UserSampler, parse, run_floor, run_ours, start

EVENTS: list[tuple[str, int, bool]] = []  # (point, ns, on the engine thread)
SCHEDULED: list[
    tuple[int, int, int]
] = []  # per engine step: (ns at its schedule, tokens, new requests)
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
    from genlm_backend.engine_thread import EngineThread
    from genlm_backend.llm import base
    from genlm_backend.llm.vllm import capture as vllm_capture
    from genlm_backend.llm.vllm import remote_rows
    from genlm_backend.llm.vllm import runner as vllm_engine
    from genlm_backend.llm.vllm import session_pool as vllm_sessions
    from genlm_backend.llm.vllm.logprobs import LogprobSteps
    from genlm_backend.llm.vllm.vllm_engine import VLLMEngine

    wrap(vllm_capture.LogprobsCaptureProcessor, "apply", "apply", "apply_end")
    wrap(vllm_capture.CaptureSink, "capture", None, "rows_out")
    wrap(vllm_engine, "_resolve", "rows_on_loop", None)
    wrap(UserSampler, "step", "draw", "draw_end")
    wrap(VLLMEngine, "evaluate", "batch_in", None)
    wrap(LogprobSteps, "start_batch", "plan", "plan_end")
    wrap(EngineThread, "hold", None, "hold_end")
    wrap(EngineThread, "submit_hold_safe", "to_engine", None)
    wrap(vllm_sessions.SessionPool, "plan", None, "sessions_planned")
    wrap(VLLMEngine, "_on_step", "on_step", None)
    wrap(_batch_queue.LoopQueue, "start", "batch_start", None)
    wrap(_batch_queue.LoopQueue, "finish", "resolve", "resolved")
    wrap(base.AsyncLM, "next_token_logprobs", "request", None)
    # rows from a worker process
    wrap(remote_rows, "deliver_remote", "remote_rows", "remote_rows_end")


def install_engine(engine: object) -> None:
    """Points inside vLLM's step, where this version has them (ours and the floor alike)."""
    from genlm_backend.llm.vllm import internals

    wrap(engine, "step", "step", "step_end")
    core = getattr(engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None:
        schedule = scheduler.schedule

        def counted(*args, **kwargs):
            out = schedule(*args, **kwargs)
            SCHEDULED.append(
                (
                    time.perf_counter_ns(),
                    out.total_num_scheduled_tokens,
                    len(out.scheduled_new_reqs),
                )
            )
            return out

        scheduler.schedule = counted
    runner = internals.engine._model_runner(engine)
    for owner, name in (
        (getattr(core, "scheduler", None), "schedule"),
        (runner, "execute_model"),
        (runner, "sample_tokens"),
        (getattr(runner, "sampler", None), "forward"),
        (runner, "_bookkeeping_sync"),
        (getattr(core, "scheduler", None), "update_from_output"),
        (engine.output_processor, "process_outputs"),
    ):
        if owner is not None and hasattr(owner, name):
            wrap(owner, name, name, f"{name}_end")
    executor = getattr(core, "model_executor", None)
    if (
        runner is None and executor is not None
    ):  # the model runs in worker processes: the calls to them
        for name in ("execute_model", "sample_tokens"):
            wrap(executor, name, f"executor.{name}", f"executor.{name}_end")


def step_intervals(events: list[tuple[str, int, bool]]) -> dict[str, tuple[float, float]]:
    """Median and mean microseconds between consecutive points, over steps. The mean counts the
    rare slow steps (W5's forks) that the median hides."""
    gaps: dict[str, list[float]] = {}
    previous = None
    for point, ns, _ in events:
        if previous is not None:
            key = f"{previous[0]} -> {point}"
            gaps.setdefault(key, []).append((ns - previous[1]) / 1e3)
        previous = (point, ns)
    return {k: (statistics.median(v), statistics.fmean(v)) for k, v in gaps.items() if len(v) >= 8}


def step_kinds(steps: list[tuple[int, int, int]]) -> str:
    """Engine steps with and without new requests (W5's forks): how many, their scheduled
    tokens and the mean time from one schedule to the next."""
    kinds: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for (ns, tokens, new), (next_ns, _, _) in itertools.pairwise(steps):
        kinds[new > 0].append(((next_ns - ns) / 1e3, tokens))
    parts = []
    for has_new, label in ((False, "steps without new requests"), (True, "with new requests")):
        entries = kinds[has_new]
        if entries:
            parts.append(
                f"{label}: {len(entries)}, mean {statistics.fmean(e[0] for e in entries):.0f} us, "
                f"tokens median {statistics.median(e[1] for e in entries):.0f} "
                f"max {max(e[1] for e in entries)}"
            )
    return "; ".join(parts)


def main() -> None:
    args = parse(sys.argv[1:])
    # installed before the model: its batchers keep what they are given
    lm, prompt = start(args, install)
    install_engine(lm.llm.llm_engine)
    for workload in args.workloads:
        for n in args.particles:
            run_ours(lm, prompt, n, args, workload)  # warm-up
            ours, floors = [], []
            for _ in range(args.repeats):
                EVENTS.clear()
                SCHEDULED.clear()
                start_s = time.perf_counter()
                run_ours(lm, prompt, n, args, workload)
                ours.append(time.perf_counter() - start_s)
                run_events, run_steps = list(EVENTS), list(SCHEDULED)
                EVENTS.clear()
                start_s = time.perf_counter()
                run_floor(lm, prompt, n, args)
                floors.append(time.perf_counter() - start_s)
            floor_events = list(EVENTS)
            steps = [ns for point, ns, _ in floor_events if point == "step"]
            floor_step = statistics.median((b - a) / 1e3 for a, b in itertools.pairwise(steps))
            print(
                f"\n{workload} N={n}: ours {statistics.median(ours) * 1e3:.1f} ms, floor "
                f"{statistics.median(floors) * 1e3:.1f} ms, "
                f"ratio {statistics.median(ours) / statistics.median(floors):.3f}; "
                f"floor step {floor_step:.0f} us"
            )
            starts = [ns for point, ns, _ in run_events if point == "apply"]
            if len(starts) < 2:  # the capture runs in a worker process
                starts = [ns for point, ns, _ in run_events if point == "step"]
            spans = [(b - a) / 1e3 for a, b in itertools.pairwise(starts)]
            print(
                f"  our step (capture to capture): median {statistics.median(spans):.0f} us, mean "
                f"{statistics.fmean(spans):.0f} us, {len(spans) + 1} steps"
            )
            print(f"  {step_kinds(run_steps)}")
            print("     median       mean")
            for key, (median, mean) in step_intervals(run_events).items():
                print(f"  {median:9.1f} {mean:9.1f} us  {key}")
            print("  the floor:")
            for key, (median, mean) in step_intervals(floor_events).items():
                print(f"  {median:9.1f} {mean:9.1f} us  {key}")
    lm.cleanup()


if __name__ == "__main__":
    main()
