"""What one part of the default path gives W1 and W5, with it and without it in one process.

``--change`` names the part and its two modes (the default's first):

* ``steady``: steady held steps (``internals.install_steady_steps``) ``on`` and ``off``
  (vLLM's own ``schedule`` and ``update_from_output`` for every step);
* ``call``: ``next_token_logprobs`` as it is (``coroutine``, an ``async def``: ``gather``
  wraps each call in a task) and returning the batcher's future itself (``future``, which
  ``gather`` takes without a task; what the call was before it became an ``async def``,
  given up because a future is not a coroutine to ``asyncio.wait``, ``inspect`` or mocks);
* ``slots``: sessions in every scheduler slot (``all``) and in all but one (``spare``, the
  bound before parked sessions gave their slots up to the requests that need them); they
  differ where N reaches ``max_num_seqs``, on a CPU at N=256 with vLLM's defaults.

Runs the workload of record (``bench_smc_vllm``'s W1 or W5 on the default constructor) run
by run in turn, the order reversed every other repeat. Before timing, one seeded run each
way keeps every row (``max_row_diff``: 0.0 for ``steady`` and ``call``, which change which
code runs a step, not what it computes; with ``slots`` the ``spare`` mode computes one
context a step as a new request, whose row may differ by rounding), and
``steady_steps_share`` is the share of steps that took the steady path, of the runs that
went through it (with ``steady``, those ``on``). Prints a line per configuration; with
``--out-dir``, writes ``<change>_ab_<gpu|cpu>.json`` (or ``--name``).

    python benchmarks/diagnostics/ab.py --change steady --gpu --tokenizer-dir DIR --particles 64 256
    OMP_NUM_THREADS=1 python benchmarks/diagnostics/ab.py --change slots --micro --particles 64 256
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.common import summarise
from benchmarks.diagnostics._w1 import alternate, parse, row_difference, start, write_rows
from genlm_backend.llm.base import AsyncLM

AS_IS = AsyncLM.next_token_logprobs


def as_future(self, token_ids, lora_name=None):
    return self._logprobs_batcher.enqueue(self._request(token_ids, lora_name))


class Change:
    """The two modes of one part of the default path and how to switch between them."""

    def __init__(self, name: str, lm: Any):
        self.name, self.lm = name, lm
        self.modes = {"steady": ("on", "off"), "call": ("coroutine", "future"),
                      "slots": ("all", "spare")}[name]
        if name == "steady" and lm.engine._steady is None:
            raise SystemExit("the steady path is not installed on this engine")

    def switch(self, mode: str) -> None:
        lm, default = self.lm, mode == self.modes[0]
        if self.name == "steady":
            steady = lm.engine._steady
            scheduler = steady.scheduler
            # "off": the scheduler's calls as they were before steady steps wrapped them
            # (monkeypatched here: nothing in the package switches them back)
            scheduler.schedule = steady.schedule if default else steady._general_schedule
            scheduler.update_from_output = (
                steady.update_from_output if default else steady._general_update
            )
        elif self.name == "call":
            AsyncLM.next_token_logprobs = AS_IS if default else as_future
        else:
            lm.set_sessions(True if default else lm._session_slots - 1)

    def counts(self) -> tuple[int, int]:
        """Engine steps so far that took the steady path, and those that took vLLM's."""
        engine = self.lm.stats()["engine"]
        return engine["num_steady_steps"], engine["num_steps"] - engine["num_steady_steps"]


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--change", choices=("steady", "call", "slots"), required=True)
    known, rest = parser.parse_known_args(sys.argv[1:])
    args = parse(rest)
    lm, prompt = start(args)
    change = Change(known.change, lm)
    default, other = change.modes
    results = []
    try:
        for workload in args.workloads:
            for n in args.particles:
                max_diff = row_difference(
                    lm, prompt, n, args, workload, change.switch, change.modes
                )
                before = change.counts()
                walls = alternate(lm, prompt, n, args, workload, change.switch, change.modes)
                num_steady, num_general = (a - b for a, b in zip(change.counts(), before))
                change.switch(default)
                base = statistics.median(walls[other])
                for mode in change.modes:
                    row = {
                        "workload": workload,
                        "N": n,
                        "T": args.steps,
                        "change": change.name,
                        "mode": mode,
                        **summarise(walls[mode]),
                        f"speedup_vs_{other}": base / statistics.median(walls[mode]),
                        "max_row_diff": max_diff,
                        "steady_steps_share": round(
                            num_steady / max(num_steady + num_general, 1), 3
                        ),
                    }
                    results.append(row)
                    print(
                        f"{workload} N={n} {change.name} {mode}: "
                        f"wall median {row['median_s'] * 1e3:.1f} ms "
                        f"(min {row['min_s'] * 1e3:.1f} max {row['max_s'] * 1e3:.1f}), "
                        f"{row[f'speedup_vs_{other}']:.3f}x {other}; "
                        f"rows differ by {max_diff:.3g}; "
                        f"steady steps {row['steady_steps_share']:.0%}",
                        flush=True,
                    )
    finally:
        change.switch(default)
        lm.cleanup()
    write_rows(args, f"{change.name}_ab", results)


if __name__ == "__main__":
    main()
