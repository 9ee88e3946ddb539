"""W1 and W5 of record over alternating engine starts: the floor, ours and 0.3.1, repeated.

The same workloads as ``bench_smc_vllm.py`` (read its docstring), but every engine runs
alone in a child process of its own, and the three take turns: floor, ours, peer, floor,
ours, peer, ... (``--starts`` rounds). The spread between engine starts on one machine is
larger than the spread within one, so a figure here is the median across starts of each
start's median, with the min and max across starts; ``ratio`` (the whole wall) and
``ratio_nosample`` are taken within each start (ours against the floor of the same round).
Each start also runs one W1 run at the largest N under torch's profiler: ``busy`` is the GPU's
kernel time over that run's wall.

    python benchmarks/bench_smc_starts.py --starts 3 --gpu --tokenizer-dir .gpu_assets/tekken \\
        --peer /tmp/peer

Every other flag is ``bench_smc_vllm.py``'s. ``--merge A.json B.json ...`` runs nothing: it
writes the tables of those runs' rounds together, as one run of all of them would (rounds run
in separate calls, say), under ``--name`` in ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for `benchmarks`

from benchmarks import bench_smc_vllm as bench
from benchmarks.common import print_table, write_json
from benchmarks.models import workload


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def tables(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, list[dict]]:
    """Per workload and N: medians across starts, with min and max."""
    out = {}
    for w in args.workloads:
        rows = []
        for n in args.particles:
            key = str(n)
            floors = [r["floor"]["floor"][key]["median_s"] for r in rounds]
            walls = [r["ours"][w][key]["wall"]["median_s"] for r in rounds]
            nosample = [r["ours"][w][key]["wall_nosample"]["median_s"] for r in rounds]
            row: dict[str, Any] = {"N": n, "T": args.steps, "starts": len(rounds)}
            for name, values in (
                ("floor_s", floors), ("wall_s", walls),
                ("ratio", [s / f for s, f in zip(walls, floors)]),
                ("ratio_nosample", [s / f for s, f in zip(nosample, floors)]),
            ):
                s = spread(values)
                row.update({name: s["median"], f"{name}_min": s["min"], f"{name}_max": s["max"]})
            if all("process" in r for r in rounds):
                walls_p = [r["process"][w][key]["wall"]["median_s"] for r in rounds]
                nosample_p = [r["process"][w][key]["wall_nosample"]["median_s"] for r in rounds]
                for name, values in (
                    ("process_wall_s", walls_p),
                    ("process_ratio_nosample", [s / f for s, f in zip(nosample_p, floors)]),
                    ("process_speedup", [o / p for o, p in zip(walls, walls_p)]),
                ):
                    s = spread(values)
                    row.update({name: s["median"], f"{name}_min": s["min"],
                                f"{name}_max": s["max"]})
            if all("peer" in r for r in rounds):
                peers = [r["peer"][w][key]["wall"]["median_s"] for r in rounds]
                s = spread([p / o for p, o in zip(peers, walls)])
                row.update(peer_wall_s=statistics.median(peers),
                           peer_ratio=statistics.median(p / f for p, f in zip(peers, floors)),
                           speedup_vs_peer=s["median"],
                           speedup_vs_peer_min=s["min"], speedup_vs_peer_max=s["max"])
            rows.append(row)
        out[w] = rows
    return out


# What the merged runs must share of their machines.
MACHINE = ("gpu", "cpu_count", "python", "torch", "transformers", "vllm")


def merge(paths: list[Path]) -> tuple[list[dict], dict[str, Any], dict[str, Any]]:
    """The rounds of several runs' JSON files (one run a device call, say), in order, the
    configuration they share (the first file's, with the number of starts summed) and the
    machine they ran on."""
    payloads = [json.loads(Path(p).read_text()) for p in paths]
    config = dict(payloads[0]["config"])
    for path, other in zip(paths[1:], payloads[1:]):
        for key in ("gpu", "size", "workloads", "particles", "steps", "prompt_len", "repeats",
                    "seed", "engine_opts"):
            if other["config"].get(key) != config.get(key):
                raise SystemExit(f"{path}: {key} differs from {paths[0]}'s")
        if any(other["machine"].get(k) != payloads[0]["machine"].get(k) for k in MACHINE):
            raise SystemExit(f"{path}: ran on another machine than {paths[0]}")
    rounds = [r for other in payloads for r in other["rounds"]]
    config.update(starts=len(rounds), merged_from=[p.name for p in paths])
    return rounds, config, payloads[0]["machine"]


def main() -> dict:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--starts", type=int, default=3)
    parser.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                        help="no runs: the tables of these files' rounds together")
    known, rest = parser.parse_known_args()
    args = bench.parse_args(rest)
    if known.merge:
        rounds, config, machine = merge(known.merge)
        args = argparse.Namespace(**{**config, "name": args.name, "out_dir": args.out_dir})
    else:
        model_dir, engine_opts, prompt = workload(args)
        config = {**vars(args), "starts": known.starts, "model_dir": str(model_dir),
                  "engine_opts": engine_opts}
        rounds, machine = [], {}
    for k in range(len(rounds), config["starts"]):
        one = {"floor": bench.child_result("floor", model_dir, engine_opts, prompt, rest),
               "ours": bench.child_result("ours", model_dir, engine_opts, prompt, rest)}
        if args.engine_process:
            one["process"] = bench.child_result("process", model_dir, engine_opts, prompt, rest)
        if args.peer:
            one["peer"] = bench.child_result("peer", model_dir, engine_opts, prompt, rest,
                                              args.peer)
        rounds.append(one)
        print(f"start {k + 1} of {config['starts']} done", flush=True)
        # What has run so far, should a later start not finish.
        write_json(f"{args.name or 'smc_starts'}_partial", {"config": config, "rounds": rounds},
                   args.out_dir)
    result = tables(rounds, args)
    for w, rows in result.items():
        print(f"\n{w.upper()} ({'GPU' if args.gpu else 'CPU'}; medians across "
              f"{len(rounds)} starts, each the median of {args.repeats})")
        print_table(rows, [c for c in rows[0] if not c.endswith(("_min", "_max"))])
    busy = {"ours_w1": [r["ours"].get("device") for r in rounds],
            "floor": [r["floor"].get("device", {}).get("0") for r in rounds]}
    print("\nGPU busy at N =", max(args.particles), busy)
    payload = {
        **({"machine": machine} if machine else {}),  # the machine of the merged runs
        "config": config,
        "tables": result,
        "device_busy": busy,
        "model_runner": [r["ours"]["stats"]["engine"].get("model_runner") for r in rounds],
        "rounds": rounds,
    }
    name = args.name or f"smc_starts_{'gpu' if args.gpu else 'cpu'}"
    print("wrote", write_json(name, payload, args.out_dir))
    return payload


if __name__ == "__main__":
    main()
