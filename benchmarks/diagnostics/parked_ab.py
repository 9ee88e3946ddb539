"""W1/W5 with and without the scheduler bypass for parked sessions, side by side in one process.

``internals.install_parked_bypass`` keeps parked sessions out of vLLM's walk over its waiting
queues. This runs the workload of record (``bench_smc_vllm``'s W1 or W5, the default
constructor) alternately with the bypass (``bypass``) and with vLLM's own ``schedule``
(``vllm``), and prints per configuration the median wall with min/max, the mean time of a
``schedule()`` call and the median number of parked sessions at a step.

    python benchmarks/diagnostics/parked_ab.py --gpu --tokenizer-dir DIR --workloads w5 w1 \\
        --particles 64 256
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=4 python benchmarks/diagnostics/parked_ab.py --micro \\
        --workloads w5 --particles 64 256 --engine-opt max_num_seqs=1024

(``max_num_seqs=1024`` is vLLM's default on 80 GB GPUs; on a CPU it is 256, which leaves W5 at
N=256 no room to park.) ``--out-dir DIR`` writes ``parked_ab.json`` there.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.diagnostics._w1 import parse, run_ours, start


def main() -> None:
    args = parse(sys.argv[1:])
    lm, prompt = start(args)
    from genlm_backend.llm.vllm.internals.engine_core import _scheduler
    from genlm_backend.llm.vllm.internals.installed import installed_on

    scheduler = _scheduler(lm.llm.llm_engine)
    if not installed_on(scheduler).get("parked_bypass"):
        raise SystemExit("this engine's scheduler has no parked-session bypass")
    calls: list[tuple[float, int]] = []  # per schedule(): (us, parked sessions)

    def timed(schedule):
        def call(*a, **k):
            start_ns = time.perf_counter_ns()
            out = schedule(*a, **k)
            calls.append(
                (
                    (time.perf_counter_ns() - start_ns) / 1e3,
                    scheduler.num_waiting_for_streaming_input,
                )
            )
            return out

        return call

    variants = {
        "bypass": timed(scheduler.schedule),
        "vllm": timed(type(scheduler).schedule.__get__(scheduler)),
    }
    results = {}
    for workload in args.workloads:
        for n in args.particles:
            runs = {v: {"walls": [], "schedule_us": [], "parked": []} for v in variants}
            for schedule in variants.values():  # warm-up
                scheduler.schedule = schedule
                run_ours(lm, prompt, n, args, workload)
            for repeat in range(args.repeats):
                order = list(variants.items())
                for name, schedule in order if repeat % 2 == 0 else order[::-1]:
                    scheduler.schedule = schedule
                    calls.clear()
                    start_s = time.perf_counter()
                    run_ours(lm, prompt, n, args, workload)
                    runs[name]["walls"].append(time.perf_counter() - start_s)
                    runs[name]["schedule_us"].append(statistics.fmean(c[0] for c in calls))
                    runs[name]["parked"].append(statistics.median(c[1] for c in calls))
            for name, run in runs.items():
                walls = run["walls"]
                print(
                    f"{workload} N={n} {name}: wall median {statistics.median(walls) * 1e3:.1f} ms "
                    f"(min {min(walls) * 1e3:.1f} max {max(walls) * 1e3:.1f}); schedule mean "
                    f"{statistics.median(run['schedule_us']):.0f} us/step; parked median "
                    f"{statistics.median(run['parked']):.0f}",
                    flush=True,
                )
                results[f"{workload}_{n}_{name}"] = run
    lm.cleanup()
    if args.out_dir is not None:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.out_dir) / "parked_ab.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
