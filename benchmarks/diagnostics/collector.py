"""What Python's garbage collector costs W1 and W5, and what a program gets back by tuning it.

Runs the workload of record (``bench_smc_vllm``'s W1 or W5 on the default constructor) in one
process under three settings of the collector, which belong to the program, not to this
package (the backend never changes them):

- ``default``: the settings the process started with (CPython's ``(700, 10, 10)``), as the
  figures of record run;
- ``fewer``: ``gc.set_threshold(50_000, 20, 20)``, a young-generation pass every 50,000 net
  allocations instead of every 700;
- ``off``: ``gc.disable()`` for the run.

The settings alternate run by run (the order reversed every other repeat), and the process's
own settings come back after each run. For ``default`` it also times the collector's passes
(``gc.callbacks``): milliseconds a step per generation. Prints a line per configuration and,
with ``--out-dir``, writes ``collector_<gpu|cpu>.json`` (or ``--name``) there.

    python benchmarks/diagnostics/collector.py --gpu --tokenizer-dir DIR --particles 64 256
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/collector.py --micro --particles 64 256 \\
        --engine-opt max_num_seqs=1024
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.common import summarise
from benchmarks.diagnostics._w1 import CollectorClock, parse, run_ours, start, write_rows

SETTINGS = ("default", "fewer", "off")


def run_with(setting: str, run) -> tuple[float, CollectorClock | None]:
    """One run under ``setting``: its wall, and under ``default`` the clock of the collector's
    passes during it. The collector's settings are the process's again after."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    clock = None
    if setting == "fewer":
        gc.set_threshold(50_000, 20, 20)
    elif setting == "off":
        gc.disable()
    else:
        clock = CollectorClock()
    try:
        started = time.perf_counter()
        run()
        return time.perf_counter() - started, clock
    finally:
        if clock is not None:
            clock.close()
        gc.set_threshold(*threshold)
        if enabled:
            gc.enable()


def main() -> None:
    args = parse(sys.argv[1:])
    lm, prompt = start(args)
    rows = []
    try:
        for workload in args.workloads:
            for n in args.particles:
                def run(n=n, workload=workload):
                    run_ours(lm, prompt, n, args, workload)

                run()  # warm-up
                walls, clocks = {s: [] for s in SETTINGS}, []
                for repeat in range(args.repeats):
                    for setting in SETTINGS if repeat % 2 == 0 else SETTINGS[::-1]:
                        wall, clock = run_with(setting, run)
                        walls[setting].append(wall)
                        if clock is not None:
                            clocks.append(clock)
                steps = args.repeats * args.steps
                base = statistics.median(walls["default"])
                for setting in SETTINGS:
                    row = {"workload": workload, "N": n, "T": args.steps, "setting": setting,
                           **summarise(walls[setting]),
                           "speedup": base / statistics.median(walls[setting])}
                    if setting == "default":
                        row["collector_ms_per_step"] = [
                            round(1e3 * sum(c.seconds[g] for c in clocks) / steps, 3)
                            for g in range(3)
                        ]
                        row["passes_per_step"] = [
                            round(sum(c.counts[g] for c in clocks) / steps, 2) for g in range(3)]
                    rows.append(row)
                    extra = (f"; collector {row['collector_ms_per_step']} ms a step (gen 0/1/2)"
                             if setting == "default" else "")
                    print(f"{workload} N={n} {setting}: wall median {row['median_s'] * 1e3:.1f} ms "
                          f"(min {row['min_s'] * 1e3:.1f} max {row['max_s'] * 1e3:.1f}), "
                          f"{row['speedup']:.3f}x the default{extra}", flush=True)
    finally:
        lm.cleanup()
    write_rows(args, "collector", rows)


if __name__ == "__main__":
    main()
