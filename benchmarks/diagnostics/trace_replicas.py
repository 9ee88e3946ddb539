"""Where a W1 step goes with replicas in processes of their own (``ReplicatedLM.from_name``),
or with one engine in this process (``--replicas 1``): the step split into this process's
part and the engine's or replicas' (per batch; and the replicas' ``stats()`` timings: a
batch's round trip, the rows' copy out, each server's evaluation, ring write and idle
time), the time this process spends in Python's collector, and a profile of this process
over one run (cProfile's own time, top functions; from Python 3.12 it sees every thread).

    python benchmarks/diagnostics/trace_replicas.py --gpu --tokenizer-dir .gpu_assets/tekken \\
        --replicas 2 --particles 512
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/trace_replicas.py --micro --replicas 2 \\
        --particles 256 --engine-opt max_num_seqs=1024
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.bench_smc_vllm import UserSampler, smc
from benchmarks.diagnostics._w1 import CollectorClock, parse
from benchmarks.models import workload


def build(replicas: int, args: argparse.Namespace) -> tuple:
    model_dir, opts, prompt = workload(args, micro=args.micro)
    if replicas == 1:
        from genlm_backend.llm.vllm import AsyncVirtualLM

        return AsyncVirtualLM.from_name(str(model_dir), engine_opts=opts), prompt
    from genlm_backend.llm import ReplicatedLM

    return ReplicatedLM.from_name(str(model_dir), replicas=replicas, engine_opts=opts), prompt


def per_batch(stats: dict) -> list[dict]:
    """Each replica's timings in milliseconds per batch."""
    out = []
    for replica in stats.get("replicas", ()):
        transport, server = replica["transport"], replica["process"]["server"]
        line = {}
        for name, part in (("transport", transport), ("server", server)):
            batches = max(part["num_batches"], 1)
            line.update({f"{name}.{k[:-2]}_ms": round(1000 * v / batches, 2)
                         for k, v in part.items() if k.endswith("_s")})
        out.append(line)
    return out


class BatchClock:
    """Wraps the evaluation of ``lm``'s log-probability batcher: per batch, the time from the previous batch's rows
    reaching this process's loop to this batch's start (this process's part of a step: the
    rows handed out, the program's sampling, the next requests checked and batched) and from
    its start to its rows (the engine's part, or the replicas')."""

    def __init__(self, lm):
        self.batcher = lm._logprobs_batcher
        self.evaluate = self.batcher.evaluate
        self.ours, self.theirs = [], []
        self._done = None
        self.batcher.evaluate = self

    def __call__(self, requests):
        started = time.perf_counter()
        if self._done is not None:
            self.ours.append(started - self._done)
        result = self.evaluate(requests)
        if isinstance(result, asyncio.Future):
            result.add_done_callback(lambda _: self._finish(started))
        else:
            self._finish(started)
        return result

    def _finish(self, started: float) -> None:
        self._done = time.perf_counter()
        self.theirs.append(self._done - started)

    def close(self) -> None:
        self.batcher.evaluate = self.evaluate


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--replicas", type=int, default=2)
    known, rest = parser.parse_known_args()
    args = parse(rest)
    lm, prompt = build(known.replicas, args)
    try:
        n = args.particles[0]
        vocab = lm.vocab_size
        asyncio.run(smc(lm, prompt, n, args.steps, UserSampler("w1", vocab, 0)))  # warm-up
        walls = []
        clock = CollectorClock()
        batches = BatchClock(lm)
        for repeat in range(3):
            sampler = UserSampler("w1", vocab, repeat + 1)
            start = time.perf_counter()
            asyncio.run(smc(lm, prompt, n, args.steps, sampler))
            walls.append((time.perf_counter() - start, sampler.seconds))
        clock.close()
        batches.close()
        ours, theirs = sorted(batches.ours), sorted(batches.theirs)
        print(f"a batch, median (ms): this process's part {1000 * ours[len(ours) // 2]:.2f}, "
              f"the engine's or replicas' part {1000 * theirs[len(theirs) // 2]:.2f} "
              f"({len(theirs)} batches)")
        after = lm.stats()
        steps = 3 * args.steps
        passes = [f"gen{g} {1000 * clock.seconds[g] / steps:.2f} ms ({clock.counts[g]} passes)"
                  for g in range(3)]
        print("collector in this process, per step: " + ", ".join(passes))
        for wall, sampled in walls:
            step = 1000 * wall / args.steps
            print(f"replicas={known.replicas} N={n}: wall {wall:.3f} s ({step:.1f} ms a step), "
                  f"user sampling {1000 * sampled / args.steps:.1f} ms a step")
        if "replicas" in after:
            print("per batch (the warm-up included):")
            for i, line in enumerate(per_batch(after)):
                print(f"  replica {i}: {line}")
        profile = cProfile.Profile()
        profile.enable()
        asyncio.run(smc(lm, prompt, n, args.steps, UserSampler("w1", vocab, 9)))
        profile.disable()
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    finally:
        lm.cleanup()


if __name__ == "__main__":
    main()
