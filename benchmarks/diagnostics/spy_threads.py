"""Which thread of which process a W1 (or W5) step waits on: py-spy samples this process and,
with replicas, each replica's process while the workload runs back to back, and this prints
each thread's busy share and milliseconds a step.

A thread is busy where its innermost frame is not a wait (the event loop's poll, a lock, a
pipe read, the engine thread's hold); time inside a CUDA call counts as busy. The workload
is ``bench_smc_vllm``'s with the default constructor (``--replicas 1``: one engine in this
process; ``k > 1``: ``ReplicatedLM.from_name(..., replicas=k)``). Needs ``py-spy`` on the
PATH (or ``--py-spy``) and the right to trace this process's children.

    python benchmarks/diagnostics/spy_threads.py --gpu --tokenizer-dir DIR --replicas 2 --particles 512
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/spy_threads.py --micro --replicas 1 --particles 64
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.bench_smc_vllm import UserSampler, smc
from benchmarks.diagnostics._w1 import parse
from benchmarks.diagnostics.trace_replicas import build

# Innermost frames that wait rather than work (py-spy's raw format names them so).
_WAITS = ("select (selectors.py", "_recv (multiprocessing", "Condition.wait (threading.py",
          "hold (genlm_backend/_engine_thread.py", "_work (genlm_backend/_engine_thread.py")


def busy_shares(raw: Path) -> dict[str, float]:
    """Busy share of each thread (by name) in one py-spy raw recording."""
    total: collections.Counter = collections.Counter()
    busy: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1].strip('"')
        total[thread] += int(count)
        if not any(wait in frames[-1] for wait in _WAITS):
            busy[thread] += int(count)
    return {thread: busy[thread] / n for thread, n in total.items() if n}


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--py-spy", default="py-spy")
    known, rest = parser.parse_known_args()
    args = parse(rest)
    lm, prompt = build(known.replicas, args)
    workload, n = args.workloads[0], args.particles[0]

    def run(seed: int) -> float:
        start = time.perf_counter()
        asyncio.run(smc(lm, prompt, n, args.steps, UserSampler(workload, lm.vocab_size, seed)))
        return time.perf_counter() - start

    try:
        run(0)
        plain = [run(seed) for seed in range(1, 6)]
        processes = [("this process", os.getpid())] + [
            (f"replica {i}", r._child.process.pid) for i, r in enumerate(getattr(lm, "replicas", ()))]
        with tempfile.TemporaryDirectory() as folder:
            spies = [(name, Path(folder) / f"{i}.txt") for i, (name, _) in enumerate(processes)]
            running = [subprocess.Popen([known.py_spy, "record", "-p", str(pid), "--threads", "--idle",
                                         "--nonblocking", "-r", "250", "-d", str(int(known.seconds)),
                                         "-f", "raw", "-o", str(path)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                       for (_, pid), (_, path) in zip(processes, spies)]
            time.sleep(1.0)
            sampled, end = [], time.monotonic() + known.seconds - 2
            while time.monotonic() < end:
                sampled.append(run(7))
            for spy in running:
                spy.wait()
            step_ms = 1000 * statistics.median(sampled) / args.steps
            print(f"{workload} N={n} replicas={known.replicas}: wall {statistics.median(plain):.3f} s "
                  f"(median of 5), {step_ms:.1f} ms a step while sampled ({len(sampled)} runs)")
            for name, path in spies:
                if not path.exists():
                    print(f"  {name}: no recording (py-spy could not attach?)")
                    continue
                for thread, share in sorted(busy_shares(path).items(), key=lambda kv: -kv[1]):
                    if share >= 0.01:
                        print(f"  {name:12s} {thread:28s} busy {share:6.1%} = {share * step_ms:5.1f} ms a step")
    finally:
        lm.cleanup()


if __name__ == "__main__":
    main()
