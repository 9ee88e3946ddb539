"""How much the floor of ``bench_smc_vllm.py`` (vLLM's own loop, ``llm.generate`` of N copies
of the prompt) moves between engine starts: ``--starts`` child processes one after another,
each a fresh ``vllm.LLM`` with the workload's options, each timed as the benchmark times its
floor (a warm-up, then ``--repeats``; median, min, max).

    python benchmarks/diagnostics/floor_starts.py --gpu --tokenizer-dir DIR --particles 1 256 \\
        --starts 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.bench_smc_vllm import in_child, parse_args
from benchmarks.models import workload


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--starts", type=int, default=3)
    known, rest = parser.parse_known_args()
    args = parse_args(rest)
    sys.argv[1:] = rest  # the child reads the benchmark's own flags from here
    model_dir, engine_opts, prompt = workload(args)
    for start in range(known.starts):
        floor = in_child("floor", model_dir, engine_opts, prompt, args)["floor"]
        cells = [
            f"N={n}: {r['median_s']:.4f} s ({r['min_s']:.4f}-{r['max_s']:.4f})"
            for n, r in floor.items()
        ]
        print(f"start {start + 1}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
