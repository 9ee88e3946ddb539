"""Batcher flush policies on a lockstep sampler: "idle" (default) against "timer".

N particles each await one request per step for T steps (the shape of sequential
importance sampling). The engine is simulated by a fixed cost per batch plus a cost per
row (``--batch-ms``, ``--row-ms``), so the figures isolate the batcher. The floor is the
engine time alone: one batch per step with all N rows, no queueing.

    python benchmarks/diagnostics/bench_batcher.py [--out DIR] [--steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.common import print_table, summarise, write_json
from genlm_backend.batching import Batcher


def make_engine(batch_s: float, row_s: float):
    def evaluate(keys):
        time.sleep(batch_s + row_s * len(keys))
        return [k[0] for k in keys]

    return evaluate


async def lockstep(batcher: Batcher, num_particles: int, num_steps: int) -> None:
    async def particle(i: int) -> None:
        for step in range(num_steps):
            await batcher.submit((i, step))

    await asyncio.gather(*(particle(i) for i in range(num_particles)))


def run_once(
    flush: str, num_particles: int, num_steps: int, batch_size: int, batch_s: float, row_s: float
) -> float:
    batcher = Batcher(
        make_engine(batch_s, row_s), max_batch_size=batch_size, timeout=0.02, flush=flush
    )
    start = time.perf_counter()
    asyncio.run(lockstep(batcher, num_particles, num_steps))
    elapsed = time.perf_counter() - start
    batcher.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-ms", type=float, default=2.0)
    parser.add_argument("--row-ms", type=float, default=0.02)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    batch_s, row_s = args.batch_ms / 1000, args.row_ms / 1000
    rows = []
    for num_particles in (1, 8, 64, 256):
        for batch_size in (20, 256):
            floor = args.steps * sum(
                batch_s + row_s * min(batch_size, num_particles - i)
                for i in range(0, num_particles, batch_size)
            )
            for flush in ("idle", "timer"):
                run_once(flush, num_particles, 2, batch_size, batch_s, row_s)  # warm-up
                times = [
                    run_once(flush, num_particles, args.steps, batch_size, batch_s, row_s)
                    for _ in range(args.repeats)
                ]
                stats = summarise(times)
                rows.append(
                    {
                        "N": num_particles,
                        "batch_size": batch_size,
                        "flush": flush,
                        **stats,
                        "floor_s": floor,
                        "ratio": stats["median_s"] / floor,
                    }
                )
                print(
                    f"N={num_particles} batch_size={batch_size} {flush}: {stats['median_s']:.3f} s",
                    file=sys.stderr,
                )
    print_table(
        rows, ["N", "batch_size", "flush", "median_s", "min_s", "max_s", "floor_s", "ratio"]
    )
    path = write_json(
        "batcher_flush",
        {"steps": args.steps, "batch_ms": args.batch_ms, "row_ms": args.row_ms, "rows": rows},
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
