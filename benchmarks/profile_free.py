"""A diagnostic: cProfile of W1 with free-running sessions against the floor, on one engine.

Runs W1 (``--sessions free``) and vLLM's decode loop three times each per N with a profiler
switched on from the engine thread, and prints the top functions by own time. On Python
3.12+ (the GPU machine) cProfile sees every thread, so ``ours`` includes the event loop's
work; on 3.11 only the engine thread's. Compare the counts of vLLM's own calls
(``execute_model``: engine steps) and the per-call times of the functions both share.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/profile_free.py --gpu --tokenizer-dir DIR \\
        --engine-opt async_scheduling=true --particles 8 64
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import (  # noqa: E402
    decode_loop,
    lockstep_smc,
    model_for,
    parse_args,
    parse_opts,
    vocab_size,
)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts = model_for(args)
    opts["seed"] = args.seed
    opts.update(parse_opts(args.engine_opt))
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=opts, batch_size=max(args.particles),
                                  session_lookahead=args.session_lookahead)
    lm.set_sessions("free")
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)]
    engine_thread = lm._engine_thread
    for n in args.particles:
        def ours(n: int = n) -> None:
            asyncio.run(lockstep_smc(lm, prompt, n, args.steps, args.seed, args.sampler))
            lm.close_sessions()

        def floor(n: int = n) -> None:
            engine_thread.submit(decode_loop, lm.underlying_model, prompt, n, args.steps).result()

        ours()
        floor()  # warm-up
        for name, run in (("ours", ours), ("floor", floor)):
            profile = cProfile.Profile()
            engine_thread.submit(profile.enable).result()
            for _ in range(3):
                run()
            engine_thread.submit(profile.disable).result()
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(28)
            print(f"===== N={n} {name} (3 runs of T={args.steps})")
            print(out.getvalue())
    lm.cleanup()


if __name__ == "__main__":
    main()
