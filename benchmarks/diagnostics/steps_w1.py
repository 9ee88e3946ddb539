"""Where W1's steps go, function by function: microseconds per step inside the hot functions of
``AsyncVirtualLM`` and of vLLM's engine step, for ours and for vLLM's own loop on our engine.

The workload is W1 (or W5) of ``bench_smc_vllm.py``, with the user's own sampler, and takes
its flags. Each function is wrapped with a timer (about half a microsecond a call, so ours
reads a little slow: compare functions, not totals); nested functions are counted inside
their callers too. ``trace_w1.py`` shows the order of the hand-offs instead.

    python benchmarks/diagnostics/steps_w1.py --gpu --tokenizer-dir DIR --particles 8 256
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/diagnostics/steps_w1.py \\
        --micro --particles 8 256
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.diagnostics._w1 import UserSampler, parse, run_floor, run_ours, start

TOTALS: dict[str, list[int]] = {}  # function -> [calls, nanoseconds]


def wrap(owner: object, name: str, label: str | None = None) -> None:
    original, key = getattr(owner, name), label or name
    clock = time.perf_counter_ns

    def timed(*args, **kwargs):
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            entry = TOTALS.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += clock() - start

    setattr(owner, name, timed)


def install() -> None:
    from genlm_backend import _batch_queue, batching, engine_thread
    from genlm_backend.llm import prompts
    from genlm_backend.llm.vllm import capture as vllm_capture
    from genlm_backend.llm.vllm import runner as vllm_engine
    from genlm_backend.llm.vllm import session_pool as vllm_sessions
    from genlm_backend.llm.vllm.logprobs import LogprobSteps
    from genlm_backend.llm.vllm.vllm_engine import VLLMEngine

    for owner, names in (
        (_batch_queue.LoopQueue, ("start", "finish")),
        (batching.Batcher, ("enqueue",)),
        (prompts.PromptChecker, ("request",)),
        (vllm_capture.LogprobsCaptureProcessor, ("apply",)),
        (vllm_capture.CaptureSink, ("capture",)),
        (vllm_sessions.SessionPool, ("plan", "deliver", "release", "settle")),
        (LogprobSteps, ("start_batch",)),
        (VLLMEngine, ("_on_step",)),
        (engine_thread.EngineThread, ("hold",)),
        (vllm_engine.RowBatch, ("wake",)),
    ):
        for name in names:
            wrap(owner, name)
    wrap(UserSampler, "step", "user_sampler.step")  # not vLLM's engine step


def install_engine(engine: object) -> None:
    from genlm_backend.llm.vllm import internals

    core = engine.engine_core.engine_core
    runner = internals.engine._model_runner(engine)
    wrap(engine, "step")
    for owner, names in (
        (core.scheduler, ("schedule", "update_from_output")),
        (engine.output_processor, ("process_outputs",)),
        (
            runner,
            (
                "execute_model",
                "sample_tokens",
                "_update_states",
                "_prepare_inputs",
                "_bookkeeping_sync",
                "_sample",
            ),
        ),
    ):
        for name in names:
            if owner is not None and hasattr(owner, name):
                wrap(owner, name)


def main() -> None:
    args = parse(sys.argv[1:])
    # installed before the model: its batchers keep what they are given
    lm, prompt = start(args, install)
    install_engine(lm.llm.llm_engine)
    for workload in args.workloads:
        for n in args.particles:
            for label, run in ((workload, lambda n=n, w=workload: run_ours(lm, prompt, n, args, w)),
                               ("floor", lambda n=n: run_floor(lm, prompt, n, args))):
                run()  # warm-up
                TOTALS.clear()
                start_s = time.perf_counter()
                for _ in range(args.repeats):
                    run()
                steps = args.repeats * args.steps
                print(
                    f"\nN={n} {label}: "
                    f"{1e6 * (time.perf_counter() - start_s) / steps:.0f} us per step"
                )
                for name, (calls, ns) in sorted(TOTALS.items(), key=lambda item: -item[1][1]):
                    print(
                        f"  {name:22s} {calls / steps:7.1f} calls/step "
                        f"{ns / steps / 1e3:9.1f} us/step "
                        f"{ns / calls / 1e3:8.2f} us/call"
                    )
    lm.cleanup()


if __name__ == "__main__":
    main()
