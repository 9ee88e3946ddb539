"""The prompt checker's cost per request in lockstep sampling, against the full check.

Every step each of N particles sends its context, one token longer than the step before;
``PromptChecker.request`` finds the earlier request and builds the new one on it, checking
the last id alone. The baseline is what every request would cost without that route: the
full check of the same prompts (``LogprobsRequest(check_token_ids(ids, V, None))``). Both
time N contexts of ``--context`` tokens (ids of a 131k vocabulary) over ``--steps`` steps,
the best step of each run, alternating, and report microseconds a request.

    python benchmarks/bench_prompts.py [--particles 256] [--context 160] [--runs 15]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import print_table, summarise, write_json
from genlm_backend.llm.prompts import LogprobsRequest, PromptChecker
from genlm_backend.llm.validation import check_token_ids

VOCAB = 131072


def checker_route(contexts: list[list[int]]) -> Iterator[None]:
    """Each ``next``: a request for every context, as it is then."""
    checker = PromptChecker(VOCAB, None)
    while True:
        for ids in contexts:
            checker.request(ids, None)
        yield


def full_check(contexts: list[list[int]]) -> Iterator[None]:
    while True:
        for ids in contexts:
            LogprobsRequest(check_token_ids(ids, VOCAB, None), None)
        yield


def best_step_us(
    route: Callable[[list[list[int]]], Iterator[None]],
    rng: random.Random,
    particles: int,
    context: int,
    steps: int,
) -> float:
    """Microseconds a request in the fastest of ``steps`` lockstep steps of fresh contexts
    (the first requests, of the contexts as made, unmeasured)."""
    contexts = [[rng.randrange(1000, VOCAB) for _ in range(context)] for _ in range(particles)]
    calls = route(contexts)
    next(calls)
    best = float("inf")
    for _ in range(steps):
        for ids in contexts:
            ids.append(rng.randrange(1000, VOCAB))
        start = time.perf_counter()
        next(calls)
        best = min(best, time.perf_counter() - start)
    return 1e6 * best / particles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=256)
    parser.add_argument(
        "--context", type=int, default=160, help="prompt length (W1 on the GPU: 128 + up to 32)"
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    rng = random.Random(0)
    routes = {"checker": checker_route, "full": full_check}
    times: dict[str, list[float]] = {name: [] for name in routes}
    for _ in range(args.runs):  # alternating, so drift hits both alike
        for name, route in routes.items():
            times[name].append(best_step_us(route, rng, args.particles, args.context, args.steps))
    row = {"N": args.particles, "context": args.context}
    for name, values in times.items():
        summary = summarise(values)
        row[f"{name}_us"], row[f"{name}_us_min"], row[f"{name}_us_max"] = (
            summary["median_s"], summary["min_s"], summary["max_s"])
    row["ratio"] = statistics.median(c / f for c, f in zip(times["checker"], times["full"]))
    print(
        "microseconds a request (median over runs of the best step; "
        "ratio: median of checker/full per run)"
    )
    print_table([row], ["N", "context", "checker_us", "full_us", "ratio"])
    payload = {"config": vars(args), "rows": [row], "runs_us": times}
    print("wrote", write_json("prompt_checks", payload, args.out_dir))


if __name__ == "__main__":
    main()
