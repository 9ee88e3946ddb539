"""W1 on replicas: one engine against ``ReplicatedLM`` over k engines, side by side.

The user's program of ``bench_smc_vllm.py``'s W1, unchanged: N particles x T steps from one
prompt, one ``asyncio.gather`` of ``next_token_logprobs`` a step, then the user's own sampler
(rows stacked on their device, ``torch.multinomial``, one ``.tolist()``). Configurations,
each in a process of its own, one after the other (the machine to itself):

- ``1``: ``AsyncVirtualLM.from_name(model, engine_opts=OPTS)``, the default single engine
  (its model in this process, on the first GPU);
- ``1p``: ``ReplicatedLM`` over one such engine in a process of its own
  (:class:`~genlm_backend.llm.replicas.process.ProcessReplica`): what the process costs;
- ``2`` (``k``): ``ReplicatedLM.from_name(model, replicas=k, engine_opts=OPTS)``: k engines,
  each in a process of its own on its own GPU.

Per configuration: one warm-up run, then ``--repeats`` runs, interleaved over N; medians
with min/max. ``throughput`` = N * T / wall (particle-steps per second); ``speedup`` =
throughput / the throughput of configuration ``1`` at the same N. Target (issue 27): W1 at
N=512 on 2 GPUs at least 1.8x the throughput of one.

GPU (the 1.2B bf16 Llama of W1 with the 131k tekken vocabulary; ``prepare_gpu_assets.py``
first; two GPUs)::

    python benchmarks/bench_replicas.py --gpu --tokenizer-dir .gpu_assets/tekken --configs 1 1p 2

CPU (the tiny fp32 Llama; the replicas' processes share the machine's cores, so the figures
only show that it runs)::

    OMP_NUM_THREADS=1 python benchmarks/bench_replicas.py --particles 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for `benchmarks.common`

from benchmarks.bench_smc_vllm import time_backend
from benchmarks.common import print_table, report, run_child, write_json
from benchmarks.models import workload


def build(config: str, model_dir: Path, engine_opts: dict) -> Any:
    """The model of one configuration (``1``, ``1p`` or a number of replicas)."""
    from genlm_backend.llm import ReplicatedLM
    from genlm_backend.llm.vllm import AsyncVirtualLM

    if config == "1":
        return AsyncVirtualLM.from_name(str(model_dir), engine_opts=engine_opts)
    if config == "1p":
        from genlm_backend.llm.replicas.process import start_replicas

        return ReplicatedLM(start_replicas("vllm", str(model_dir), {"engine_opts": engine_opts}, [None]))
    return ReplicatedLM.from_name(str(model_dir), replicas=int(config), engine_opts=engine_opts)


def serve(setup: str) -> None:
    """In a child process: times one configuration; reports its result to the parent."""
    setup = json.loads(setup)
    args = parse_args(setup["argv"])
    lm = build(setup["config"], Path(setup["model"]), setup["opts"])
    try:
        timed = time_backend(lm, setup["prompt"], args, "w1")
        check = asyncio.run(check_rows(lm, setup["prompt"]))
        stats = lm.stats()
        routing = stats.get("routing")
        if "replicas" in stats:
            stats = {"routing": routing, "sessions": [r.get("process", r).get("sessions") for r in stats["replicas"]]}
        else:
            stats = {"sessions": stats.get("sessions"), "engine": stats.get("engine")}
    finally:
        lm.cleanup()
    report({"timed": timed, "stats": {**stats, "check": check}})


async def check_rows(lm: Any, prompt: list[int], n: int = 16) -> dict:
    """After the timed runs: the devices the rows of n contexts came on, and (replicas) how
    far each row is from its replica's own row for the same context."""
    contexts = [[*prompt, 1000 + i] for i in range(n)]
    from genlm_backend.llm.row_ring import device_uuid

    rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
    out: dict[str, Any] = {"row_devices": sorted({str(r.device) for r in rows})}
    for i, replica in enumerate(getattr(lm, "replicas", ())):
        own = await asyncio.gather(*(replica.next_token_logprobs(c) for c in contexts))
        out[f"replica{i}_own_devices"] = sorted({str(r.device) for r in own})
        out[f"replica{i}_max_diff"] = max(float((a.cpu() - b.cpu()).abs().max()) for a, b in zip(rows, own))
        out[f"replica{i}_pid"] = getattr(replica, "pid", os.getpid())
    if torch.cuda.is_available():
        out["device_uuids_here"] = [device_uuid(i) for i in range(torch.cuda.device_count())]
        query = ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"]
        out["gpu_processes"] = subprocess.run(query, capture_output=True, text=True).stdout.splitlines()
    return out


def in_child(config: str, model_dir: Path, engine_opts: dict, prompt: list[int], args: argparse.Namespace) -> dict:
    setup = {"config": config, "model": str(model_dir), "opts": engine_opts, "prompt": prompt,
             "argv": sys.argv[1:] if args.argv is None else args.argv}
    env = {**os.environ, "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    result = run_child(__file__, setup, env, f"configuration {config}")
    result["timed"] = {int(n): v for n, v in result["timed"].items()}
    return result


def table(results: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.particles:
        base = results[args.configs[0]]["timed"][n]["wall"]["median_s"]
        for config in args.configs:
            timed = results[config]["timed"][n]
            wall = timed["wall"]
            rows.append({"config": config, "N": n, "T": args.steps, "wall_s": wall["median_s"],
                         "sample_s": timed["sample_s"],
                         "wall_min_s": wall["min_s"], "wall_max_s": wall["max_s"],
                         "throughput": n * args.steps / wall["median_s"], "speedup": base / wall["median_s"]})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the 1.2B bf16 Llama with tekken (131k) on CUDA")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="HF tokenizer folder (GPU: tekken)")
    parser.add_argument("--model-dir", default=None, help="where the random model is built (reused if present)")
    parser.add_argument("--configs", nargs="+", default=["1", "2"],
                        help="'1' (one engine), '1p' (one engine in a process of its own), or k replicas; "
                             "the first is the baseline")
    parser.add_argument("--particles", type=int, nargs="+", default=None, help="default: 512 on GPU, 16 on CPU")
    parser.add_argument("--steps", type=int, default=None, help="T (default: 32 on GPU, 8 on CPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 128 on GPU, 32 on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--name", default=None, help="result file name (default: replicas_<gpu|cpu>)")
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    args.particles = args.particles or ([512] if args.gpu else [16])
    args.steps = args.steps or (32 if args.gpu else 8)
    args.prompt_len = args.prompt_len or (128 if args.gpu else 32)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve)
        return {}
    model_dir, engine_opts, prompt = workload(args)
    results = {}
    for config in args.configs:
        results[config] = in_child(config, model_dir, engine_opts, prompt, args)
        print(f"config {config}: {json.dumps(results[config]['stats'])[:400]}", flush=True)
    rows = table(results, args)
    print(f"\nW1 on replicas ({'GPU' if args.gpu else 'CPU'}; seconds, medians of {args.repeats}; "
          f"speedup against configuration {args.configs[0]})")
    print_table(rows, [c for c in rows[0] if not c.endswith(("_min_s", "_max_s"))])
    payload = {"config": {k: v for k, v in vars(args).items() if k != "argv"} | {"model_dir": str(model_dir),
                                                                                  "engine_opts": engine_opts},
               "rows": rows, "stats": {c: r["stats"] for c, r in results.items()}}
    name = args.name or f"replicas_{'gpu' if args.gpu else 'cpu'}"
    print("wrote", write_json(name, payload, args.out_dir))
    return payload


if __name__ == "__main__":
    main()
