"""Where one step of W6 (genlm-control's SMC on our backend) goes: a timeline of its hand-offs.

The points of ``trace_w1.py`` (inside our engine step and our batching), plus genlm-control's
own: its batched ``logw_next`` call and its batched draw (``_flush_draws``). Runs the SMC of
``bench_genlm_control.py`` on our backend in this process and prints, per step (a step starts
at our capture, ``apply``), the median and mean time between consecutive points, and how the
engine steps with and without new requests (resampled particles' forks) differ.

    python benchmarks/diagnostics/trace_w6.py --gpu --tokenizer-dir DIR --consumer-site DIR \\
        --particles 256
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/diagnostics/trace_w6.py \\
        --particles 16
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks import bench_genlm_control as w6
from benchmarks.diagnostics import trace_w1 as trace
from benchmarks.models import workload


def install_consumer() -> None:
    from genlm.control import util
    from genlm.control.potential.built_in.llm import PromptedLLM

    from genlm_backend.llm import base

    trace.wrap(PromptedLLM, "batch_logw_next", "consumer_batch", "consumer_batch_end")
    trace.wrap(base.AsyncLM, "batch_next_token_logprobs", "ours_in", "ours_out")
    trace.wrap(util, "_flush_draws", "draw", "draw_end")


def main() -> None:
    args = w6.parse_args(sys.argv[1:])
    model_dir, opts, prompt = workload(args)
    model_dir = w6.with_eos(model_dir, args.eos_token)
    w6.load_consumer("ours", str(Path(args.consumer_site).resolve()))
    trace.install()
    install_consumer()
    from genlm.control import SMC, direct_token_sampler

    potential = w6.build("ours", {"model": str(model_dir), "opts": opts, "prompt": prompt})
    trace.install_engine(potential.model.llm.llm_engine)
    smc = SMC(direct_token_sampler(potential))
    for n in args.particles:
        w6.run_smc(smc, n, args, args.seed)  # warm-up
        walls, events, steps = [], [], []
        for repeat in range(args.repeats):
            trace.EVENTS.clear()
            trace.SCHEDULED.clear()
            start = time.perf_counter()
            w6.run_smc(smc, n, args, args.seed + repeat + 1)
            walls.append(time.perf_counter() - start)
            events, steps = list(trace.EVENTS), list(trace.SCHEDULED)
        starts = [ns for point, ns, _ in events if point == "apply"]
        spans = [(b - a) / 1e3 for a, b in itertools.pairwise(starts)]
        print(
            f"\nW6 N={n}: ours {statistics.median(walls) * 1e3:.1f} ms (median of {len(walls)}); "
            f"step (apply to apply) median {statistics.median(spans):.0f} us, "
            f"mean {statistics.fmean(spans):.0f} us, "
            f"{len(starts)} steps"
        )
        print(f"  {trace.step_kinds(steps)}")
        print("     median       mean")
        for key, (median, mean) in trace.step_intervals(events).items():
            print(f"  {median:9.1f} {mean:9.1f} us  {key}")
    potential.model.cleanup()


if __name__ == "__main__":
    main()
