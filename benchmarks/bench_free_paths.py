"""What free-running sessions' hot paths cost on their own, in C and in Python.

``FreeSessions`` with stand-ins for the engine, no model: N sessions, each step one row
captured and one token tapped per session (``tokens``), then N requests that extend their
session by its draw take the row (``take``: computed already, so no future), timed
separately, in microseconds a session-step; with the compiled paths (``_free_kernel``) and
in Python, alternating. Set against the same points inside W1 (``trace_free.py --cpu``),
this tells what the code costs and what running beside vLLM's step adds to it.

Reference: the Python route, in the same process.

    python benchmarks/bench_free_paths.py [--particles 256] [--steps 32] [--runs 9] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import print_table, summarise, write_json  # noqa: E402
from genlm_backend.llm import vllm_freerun  # noqa: E402
from genlm_backend.llm.prompts import LogprobsRequest  # noqa: E402


def one_run(use_kernel: bool, particles: int, steps: int) -> tuple[float, float]:
    """Microseconds a session-step in ``take`` and in ``tokens``."""
    targets: dict[int, object] = {}
    tags = itertools.count()
    pool = vllm_freerun.FreeSessions(lambda s, ids, lora: None, tags.__next__, lambda ids: None,
                                     targets.__setitem__, targets.pop, max_model_len=10**6,
                                     capacity=particles + 1, use_kernel=use_kernel)
    requests = [LogprobsRequest((i, 1, 2)) for i in range(particles)]
    pool.start_batch(requests, types.SimpleNamespace(set=lambda i, row: None))
    rows = torch.zeros(particles, 8).unbind(0)
    take_s = tokens_s = 0.0

    async def run() -> None:
        nonlocal take_s, tokens_s, requests
        for step in range(steps + 1):
            found = [(tag, [7]) for tag in list(targets)]
            for (tag, _), row in zip(found, rows):
                targets[tag](row)
            start = time.perf_counter()
            pool.tokens(found)
            tokens_s += time.perf_counter() - start
            if step == 0:  # these rows answered the batch
                continue
            following = [LogprobsRequest(r.token_ids + (7,), None, r) for r in requests]
            start = time.perf_counter()
            for request in following:
                taken = pool.take(request)
            take_s += time.perf_counter() - start
            if type(taken) is not torch.Tensor:
                raise RuntimeError(f"expected a row computed already, got {taken!r}")
            requests = following

    asyncio.run(run())
    per = 1e6 / (particles * steps)
    return take_s * per, tokens_s * per * steps / (steps + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--particles", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    if vllm_freerun.KERNEL is None:
        raise SystemExit("the free-session kernel was not built: pip install --no-deps -e .")
    runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(args.runs):
        for use_kernel in (True, False):
            runs[use_kernel].append(one_run(use_kernel, args.particles, args.steps))
    row = {"N": args.particles, "T": args.steps}
    for use_kernel, name in ((True, "kernel"), (False, "python")):
        for i, point in enumerate(("take", "tokens")):
            stats = summarise([r[i] for r in runs[use_kernel]])
            row |= {f"{point}_{name}_us": stats["median_s"], f"{point}_{name}_us_min": stats["min_s"],
                    f"{point}_{name}_us_max": stats["max_s"]}
    print("microseconds a session-step (median over runs; min/max in the JSON)")
    print_table([row], ["N", "T", "take_kernel_us", "take_python_us", "tokens_kernel_us", "tokens_python_us"])
    recorded = {f"{point}_{name}": [r[i] for r in runs[use_kernel]]
                for use_kernel, name in ((True, "kernel"), (False, "python")) for i, point in enumerate(("take", "tokens"))}
    print("wrote", write_json("free_paths", {"config": vars(args), "rows": [row], "runs_us": recorded}, args.out_dir))


if __name__ == "__main__":
    main()
