"""What returning the queued request's future from ``next_token_logprobs`` gives W1 and W5.

Runs the workload of record (``bench_smc_vllm``'s W1 or W5 on the default constructor) in
one process, run by run in turn (the order reversed every other repeat) with the call as it
is (``future``: inside a running loop it queues the request and returns its future, which
``asyncio.gather`` takes without a task) and as an ``async def`` around it (``coroutine``:
what ``gather`` wraps in a task per call, as it did before). Before timing, one seeded run
each way keeps every row: they must be equal (``max_row_diff``). Prints a line per
configuration and, with ``--out-dir``, writes ``call_ab_<gpu|cpu>.json`` (or ``--name``).

    python benchmarks/diagnostics/call_ab.py --gpu --tokenizer-dir DIR --particles 64 256
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/call_ab.py --micro --particles 64 256 \\
        --engine-opt max_num_seqs=1024
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.common import summarise
from benchmarks.diagnostics._w1 import alternate, parse, row_difference, start, write_rows
from genlm_backend.llm.base import AsyncLM

MODES = ("future", "coroutine")
AS_IS = AsyncLM.next_token_logprobs


async def as_coroutine(self, token_ids, lora_name=None):
    return await AS_IS(self, token_ids, lora_name)


def switch(mode: str) -> None:
    AsyncLM.next_token_logprobs = AS_IS if mode == "future" else as_coroutine


def main() -> None:
    args = parse(sys.argv[1:])
    lm, prompt = start(args)
    results = []
    try:
        for workload in args.workloads:
            for n in args.particles:
                max_diff = row_difference(lm, prompt, n, args, workload, switch, MODES)
                walls = alternate(lm, prompt, n, args, workload, switch, MODES)
                switch("future")
                base = statistics.median(walls["coroutine"])
                for mode in MODES:
                    row = {"workload": workload, "N": n, "T": args.steps, "call": mode, **summarise(walls[mode]),
                           "speedup_vs_coroutine": base / statistics.median(walls[mode]), "max_row_diff": max_diff}
                    results.append(row)
                    print(f"{workload} N={n} {mode}: wall median {row['median_s'] * 1e3:.1f} ms "
                          f"(min {row['min_s'] * 1e3:.1f} max {row['max_s'] * 1e3:.1f}), "
                          f"{row['speedup_vs_coroutine']:.3f}x the coroutine; rows differ by {max_diff:.3g}",
                          flush=True)
    finally:
        switch("future")
        lm.cleanup()
    write_rows(args, "call_ab", results)


if __name__ == "__main__":
    main()
