"""Where W1's steps go, function by function: microseconds per step inside the hot functions of
``AsyncVirtualLM`` and of vLLM's engine step, for ours and for the floor.

Each function is wrapped with a timer (about half a microsecond a call, so ours reads a little
slow: compare functions, not totals); nested functions are counted inside their callers too.
A diagnostic beside ``trace_w1.py`` (which shows the order of the hand-offs instead).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/steps_w1.py --gpu --tokenizer-dir DIR --particles 8 256
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/steps_w1.py --micro --particles 8 256
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import lockstep_smc, parse_args  # noqa: E402

TOTALS: dict[str, list[int]] = {}  # function -> [calls, nanoseconds]


def wrap(owner: object, name: str) -> None:
    original = getattr(owner, name)
    clock = time.perf_counter_ns

    def timed(*args, **kwargs):
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            entry = TOTALS.setdefault(name, [0, 0])
            entry[0] += 1
            entry[1] += clock() - start

    setattr(owner, name, timed)


def install() -> None:
    from genlm_backend import _batch_queue, _engine_thread, batching, sampling
    from genlm_backend.llm import prompts, vllm, vllm_capture, vllm_engine, vllm_sessions

    for owner, names in (
        (_batch_queue.LoopQueue, ("start", "finish")),
        (batching.Batcher, ("enqueue",)),
        (prompts.PromptChecker, ("request",)),
        (sampling.TokenSampler, ("_predrawn", "_draw_rows")),
        (vllm_capture.LogprobsCaptureProcessor, ("apply",)),
        (vllm_capture.CaptureSink, ("capture",)),
        (vllm_sessions.SessionPool, ("plan", "deliver", "release", "settle")),
        (vllm.AsyncVirtualLM, ("_start_batch", "_on_step")),
        (_engine_thread.EngineThread, ("hold",)),
        (vllm_engine.RowBatch, ("wake",)),
    ):
        for name in names:
            wrap(owner, name)


def install_engine(engine: object) -> None:
    from genlm_backend.llm import vllm_internals

    core = engine.engine_core.engine_core
    runner = vllm_internals._model_runner(engine)
    wrap(engine, "step")
    for owner, names in ((core.scheduler, ("schedule", "update_from_output")), (engine.output_processor, ("process_outputs",)),
                         (runner, ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs",
                                   "_bookkeeping_sync", "_sample"))):
        for name in names:
            if owner is not None and hasattr(owner, name):
                wrap(owner, name)


def main() -> None:
    args = parse_args(sys.argv[1:] + ["--sessions", "on"])
    from vllm import SamplingParams, TokensPrompt

    from benchmarks.bench_w1_vllm import model_for
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts = model_for(args)
    sampler = "batched" if args.gpu else "predraw"  # a block's rows drawn at once, as on a GPU
    install()  # before the model: its batchers keep the methods they are given
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts={**opts, "seed": 0}, batch_size=max(args.particles))
    install_engine(lm.underlying_model.llm_engine)
    prompt = [100 + i % (lm.vocab_size - 100) for i in range(args.prompt_len)]

    def floor(n: int) -> None:
        lm.close_sessions()
        lm.underlying_model.generate([TokensPrompt(prompt_token_ids=prompt)] * n,
                                     SamplingParams(max_tokens=args.steps, ignore_eos=True, detokenize=False),
                                     use_tqdm=False)

    for n in args.particles:
        for label, run in (("ours", lambda: asyncio.run(lockstep_smc(lm, prompt, n, args.steps, 0, sampler))),
                           ("floor", lambda: floor(n))):
            run()  # warm-up
            TOTALS.clear()
            start = time.perf_counter()
            for _ in range(args.repeats):
                run()
            steps = args.repeats * args.steps
            print(f"\nN={n} {label}: {1e6 * (time.perf_counter() - start) / steps:.0f} us per step")
            for name, (calls, ns) in sorted(TOTALS.items(), key=lambda item: -item[1][1]):
                print(f"  {name:22s} {calls / steps:7.1f} calls/step {ns / steps / 1e3:9.1f} us/step {ns / calls / 1e3:8.2f} us/call")
    lm.cleanup()


if __name__ == "__main__":
    main()
