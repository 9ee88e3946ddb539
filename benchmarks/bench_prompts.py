"""The prompt checker's cost per request in lockstep sampling, with and without its C kernel.

Every step each of N particles sends its context, one token longer than the step before;
``PromptChecker.request`` finds the earlier request and builds the new one on it. This times
those calls (N contexts of ``--context`` tokens, ids of a 131k vocabulary, ``--steps`` steps,
the best step of each run) with the optional compiled kernel (``_prompt_kernel``: the whole
extension step in one call, two passes over the prompt) and with the Python route (four
passes), alternating, and reports
microseconds a request. Reference: the Python route, in the same process.

    python benchmarks/bench_prompts.py [--particles 256] [--context 160] [--runs 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, summarise, write_json  # noqa: E402
from genlm_backend.llm import prompts  # noqa: E402

VOCAB = 131072


def best_step_us(kernel: object, rng: random.Random, particles: int, context: int, steps: int) -> float:
    """Microseconds a request in the fastest of ``steps`` lockstep steps of fresh contexts."""
    prompts.KERNEL = kernel
    contexts = [[rng.randrange(1000, VOCAB) for _ in range(context)] for _ in range(particles)]
    checker = prompts.PromptChecker(VOCAB, None)
    for ids in contexts:
        checker.request(ids, None)
    best = float("inf")
    for _ in range(steps):
        for ids in contexts:
            ids.append(rng.randrange(1000, VOCAB))
        start = time.perf_counter()
        for ids in contexts:
            checker.request(ids, None)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / particles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=256)
    parser.add_argument("--context", type=int, default=160, help="prompt length (W1 on the GPU: 128 + up to 32)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    kernel = prompts.KERNEL
    if kernel is None:
        sys.exit("the compiled prompt kernel is not built: run `pip install --no-deps -e .` first")
    rng = random.Random(0)
    times: dict[str, list[float]] = {"kernel": [], "python": []}
    try:
        for _ in range(args.runs):  # alternating, so drift hits both alike
            times["kernel"].append(best_step_us(kernel, rng, args.particles, args.context, args.steps))
            times["python"].append(best_step_us(None, rng, args.particles, args.context, args.steps))
    finally:
        prompts.KERNEL = kernel
    row = {"N": args.particles, "context": args.context}
    for name, values in times.items():
        summary = summarise(values)
        row[f"{name}_us"], row[f"{name}_us_min"], row[f"{name}_us_max"] = (
            summary["median_s"], summary["min_s"], summary["max_s"])
    row["ratio"] = statistics.median(k / p for k, p in zip(times["kernel"], times["python"]))
    print("microseconds a request (median over runs of the best step; ratio: median of kernel/python per run)")
    print_table([row], ["N", "context", "kernel_us", "python_us", "ratio"])
    payload = {"config": vars(args), "rows": [row], "runs_us": times}
    print("wrote", write_json("prompt_checks", payload, args.out_dir))


if __name__ == "__main__":
    main()
