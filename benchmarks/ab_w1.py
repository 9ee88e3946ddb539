"""W1 with one part of ours on and off, alternating in one process.

A diagnostic beside ``bench_w1_vllm.py`` (same model, engine options and particles): one
engine, and every round runs ours with the part on, ours with it off and the floor, in a
rotating order, so that both variants see the same host and the same drift. Prints each
variant's median against the floor's, with min-max. ``--ab`` picks the part:

* ``prompts``: the prompt checker's compiled passes (``kernel``) against the Python ones
  (``python``);
* ``sampling``: steps whose every row is forced take the tokens without vLLM's sampler
  (``skip``) against forcing them through the logits (``logits``).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/ab_w1.py --ab sampling --gpu --tokenizer-dir DIR --repeats 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import decode_loop, lockstep_smc, model_for, parse_args  # noqa: E402
from benchmarks.common import write_json  # noqa: E402
from genlm_backend.llm import prompts  # noqa: E402

KERNEL = prompts.KERNEL


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--ab", choices=("prompts", "sampling"), default="prompts")
    known, rest = pre.parse_known_args(sys.argv[1:])
    args = parse_args(rest)
    args.ab = known.ab
    if args.ab == "prompts" and KERNEL is None:
        sys.exit("the compiled prompt kernel is not built: run `pip install --no-deps -e .` first")
    steps = args.steps or (32 if args.gpu else 8)
    prompt_len = args.prompt_len or (128 if args.gpu else 32)

    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, engine_opts = model_for(args)
    engine_opts["seed"] = args.seed
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=engine_opts, batch_size=max(args.particles))
    rng = random.Random(args.seed)
    prompt = [rng.randrange(min(1000, lm.vocab_size // 2), lm.vocab_size) for _ in range(prompt_len)]
    rows = []
    try:
        for n in args.particles:
            def ours(on: bool) -> None:
                if args.ab == "prompts":
                    prompts.KERNEL = KERNEL if on else None
                else:
                    lm._forcing.enabled = on
                try:
                    asyncio.run(lockstep_smc(lm, prompt, n, steps, args.seed, args.sampler))
                    lm.close_sessions()  # within ours' time, as in bench_w1_vllm.py
                finally:
                    prompts.KERNEL = KERNEL
                    if lm._forcing is not None:
                        lm._forcing.enabled = True

            def floor() -> None:
                decode_loop(lm.underlying_model, prompt, n, steps)

            on, off = ("kernel", "python") if args.ab == "prompts" else ("skip", "logits")
            variants = {on: lambda: ours(True), off: lambda: ours(False), "floor": floor}
            for fn in variants.values():
                fn()  # warm-up
            times: dict[str, list[float]] = {name: [] for name in variants}
            names = list(variants)
            for r in range(args.repeats):
                for name in names[r % 3:] + names[: r % 3]:
                    start = time.perf_counter()
                    variants[name]()
                    times[name].append(time.perf_counter() - start)
            floor_s = statistics.median(times["floor"])
            row = {"N": n, "T": steps, "floor_s": floor_s, "times_s": times}
            for name in (on, off):
                row[f"ratio_{name}"] = statistics.median(times[name]) / floor_s
                row[f"range_{name}"] = [min(times[name]) / floor_s, max(times[name]) / floor_s]
            rows.append(row)
            print(f"N={n}: floor {floor_s:.4f} s | " + " | ".join(
                f"{name} {row[f'ratio_{name}']:.3f} ({row[f'range_{name}'][0]:.2f}-{row[f'range_{name}'][1]:.2f})"
                for name in (on, off)), flush=True)
    finally:
        lm.cleanup()
    name = f"ab_w1_{args.ab}_{'gpu' if args.gpu else 'cpu'}"
    print("wrote", write_json(name, {"config": json.loads(json.dumps(vars(args), default=str)), "rows": rows},
                              args.out_dir))


if __name__ == "__main__":
    main()
