"""What steady held steps (``internals.install_steady_steps``) give W1 and W5.

Runs the workload of record (``bench_smc_vllm``'s W1 or W5 on the default constructor) in
one process, run by run in turn (the order reversed every other repeat) with the steady
path on (the default) and off (vLLM's own ``schedule`` and ``update_from_output`` for every
step), and counts the steps each path took. Before timing, one seeded run each way keeps
every row: they must be equal (``max_row_diff``; the steady path changes which code
schedules a step, not what it computes). Prints a line per configuration and, with
``--out-dir``, writes ``steady_ab_<gpu|cpu>.json`` (or ``--name``) there.

    python benchmarks/diagnostics/steady_ab.py --gpu --tokenizer-dir DIR --particles 64 256
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/steady_ab.py --micro --particles 64 256 \\
        --engine-opt max_num_seqs=1024
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.common import summarise
from benchmarks.diagnostics._w1 import alternate, parse, row_difference, start, write_rows

MODES = ("on", "off")


def switch(steady, mode: str) -> None:
    scheduler = steady.scheduler
    if mode == "on":
        scheduler.schedule, scheduler.update_from_output = steady.schedule, steady.update_from_output
    else:
        scheduler.schedule, scheduler.update_from_output = steady.general_schedule, steady.general_update


def main() -> None:
    args = parse(sys.argv[1:])
    lm, prompt = start(args)
    steady = lm._steady
    if steady is None:
        raise SystemExit("the steady path is not installed on this engine")
    results = []
    try:
        for workload in args.workloads:
            for n in args.particles:
                max_diff = row_difference(lm, prompt, n, args, workload, lambda mode: switch(steady, mode), MODES)
                counts = [steady.num_steady, steady.num_general]
                walls = alternate(lm, prompt, n, args, workload, lambda mode: switch(steady, mode), MODES)
                num_steady, num_general = steady.num_steady - counts[0], steady.num_general - counts[1]
                switch(steady, "on")
                base = statistics.median(walls["off"])
                for mode in MODES:
                    row = {"workload": workload, "N": n, "T": args.steps, "steady": mode, **summarise(walls[mode]),
                           "speedup_vs_off": base / statistics.median(walls[mode]), "max_row_diff": max_diff}
                    if mode == "on":
                        row["steady_steps_share"] = round(num_steady / max(num_steady + num_general, 1), 3)
                    results.append(row)
                    print(f"{workload} N={n} steady {mode}: wall median {row['median_s'] * 1e3:.1f} ms "
                          f"(min {row['min_s'] * 1e3:.1f} max {row['max_s'] * 1e3:.1f}), "
                          f"{row['speedup_vs_off']:.3f}x off; rows on/off differ by {max_diff:.3g}"
                          + (f"; steady steps {row['steady_steps_share']:.0%}" if mode == "on" else ""), flush=True)
    finally:
        lm.cleanup()
    write_rows(args, "steady_ab", results)


if __name__ == "__main__":
    main()
