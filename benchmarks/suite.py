"""One command for the benchmark suite: every workload, or one, with its JSON, plot and table.

    python -m benchmarks [all|w1-vllm|w1-hf|w2|w3|w4|memory|heartbeat ...] [--quick] [--gpu]
                         [--tokenizer-dir DIR] [--vocab-dir DIR] [--peer DIR] [--out-dir DIR]

Each workload is its benchmark script (``benchmarks/bench_*.py``), run in a process of its
own so that one engine's memory, threads and failures never reach the next workload. The
script measures (seeded, one warm-up, repeats, medians with min/max, a floor measured in the
same run), prints its progress and table, and writes its JSON into ``--out-dir``; the suite
then draws ``<name>.png`` beside it, prints one summary table of every workload's headline
ratios, and writes ``suite.json`` (the summary, the commands, the seconds each took).

``--quick``: tiny sizes and one or two repeats, so the whole suite runs on a 2-core CPU in
a few minutes (CI checks that it runs; its figures are not worth quoting). ``--gpu``:
the GPU configurations of the scripts (1.2B random Llama, tekken 131k; ``--tokenizer-dir``
from ``benchmarks/prepare_gpu_assets.py``). ``--peer DIR``: W1 and W5 also time
genlm-backend 0.3.1 installed in DIR. The exit status is 1 when a workload failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import SCRATCH_DIR, print_table, write_json
from benchmarks.headlines import headlines

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    """A benchmark script and how the suite drives it."""

    name: str
    script: str  # module under benchmarks/
    describe: str
    argv: Callable[[argparse.Namespace], list[str]]  # the script's flags for these options
    json_name: Callable[[argparse.Namespace], str]  # the stem of the JSON it writes


# Quick runs skip vLLM's model compilation (about 13 s an engine on 2 cores); full runs keep it.
QUICK_ENGINE = ["--engine-opt", "enforce_eager=true"]


def _w1_vllm_argv(o: argparse.Namespace) -> list[str]:
    argv = ["--out-dir", str(o.out_dir)]
    if o.quick:
        argv += shlex.split("--particles 1 4 --steps 3 --prompt-len 16 --repeats 1") + QUICK_ENGINE
    if o.gpu:
        argv += ["--gpu", "--tokenizer-dir", str(o.tokenizer_dir)]
    if o.peer is not None:
        argv += ["--peer", str(o.peer)]
    return argv


def _w1_hf_argv(o: argparse.Namespace) -> list[str]:
    # The particles' draw: inverse CDF is the cheapest on a CPU; on a GPU the particles share
    # a TokenSampler, one exponential race over a step's rows (see benchmarks/particles.py).
    sampler = ["--sampler", "batched" if o.gpu else "cdf"]
    argv = ["--device", "cuda" if o.gpu else "cpu", *sampler, "--out", str(o.out_dir)]
    if o.quick:
        argv += shlex.split("--particles 1,8 --steps 8 --prompt-len 16 --repeats 2")
    return argv


def _w2_argv(o: argparse.Namespace) -> list[str]:
    argv = ["--out-dir", str(o.out_dir)]
    if o.quick:
        argv += (
            shlex.split("--prompts 8 --max-tokens 16 --prompt-len 16 --repeats 2") + QUICK_ENGINE
        )
    if o.gpu:
        argv += ["--gpu", "--tokenizer-dir", str(o.tokenizer_dir)]
    return argv


def _w3_argv(o: argparse.Namespace) -> list[str]:
    argv = ["--out", str(o.out_dir)]
    if o.quick:
        argv += ["--quick", "--family", "sentencepiece"]
    if o.vocab_dir is not None:
        argv += ["--vocab-dir", str(o.vocab_dir)]
    return argv


def _w4_argv(o: argparse.Namespace) -> list[str]:
    quick = shlex.split("--repeats 1 --family sentencepiece") if o.quick else []
    return ["--out", str(o.out_dir), *quick]


def _memory_argv(o: argparse.Namespace) -> list[str]:
    argv = ["--out-dir", str(o.out_dir)]
    if o.quick:
        argv += shlex.split("--rows 100 400 --repeats 1 --backends hf")
    else:
        argv += ["--backends", "hf", "vllm"]
    if o.gpu:
        argv += ["--gpu", "--tokenizer-dir", str(o.tokenizer_dir)]
    return argv


def _heartbeat_argv(o: argparse.Namespace) -> list[str]:
    argv = ["--backend", "hf", "--out", str(o.out_dir)]
    if o.quick:
        argv += shlex.split("--seconds 1 --repeats 1")
    if o.gpu:
        argv += ["--tag", "cuda"]
    return argv


WORKLOADS = {
    w.name: w
    for w in (
        Workload(
            "w1-vllm",
            "bench_smc_vllm",
            "W1 and W5, lockstep SMC with the user's own sampler on AsyncVirtualLM vs llm.generate",
            _w1_vllm_argv,
            lambda o: "smc_vllm_gpu" if o.gpu else "smc_vllm_cpu",
        ),
        Workload(
            "w1-hf",
            "bench_w1_hf",
            "W1 on AsyncTransformer vs one batched forward pass per step",
            _w1_hf_argv,
            lambda o: "w1_hf_cuda" if o.gpu else "w1_hf_cpu",
        ),
        Workload(
            "w2",
            "bench_w2_sampling",
            "W2 batched sampling tokens/s, AsyncVirtualLM vs llm.generate",
            _w2_argv,
            lambda o: "w2_sampling_gpu" if o.gpu else "w2_sampling_cpu",
        ),
        Workload(
            "w3",
            "bench_trie",
            "W3 token-character tries vs writing the output",
            _w3_argv,
            lambda o: "w3_trie",
        ),
        Workload(
            "w4",
            "bench_decode_vocab",
            "W4 decode_vocab vs a per-token loop",
            _w4_argv,
            lambda o: "w4_decode_vocab",
        ),
        Workload(
            "memory",
            "bench_memory",
            "bytes per 1000 cached log-probability rows vs V*4",
            _memory_argv,
            lambda o: "memory_gpu" if o.gpu else "memory_cpu",
        ),
        Workload(
            "heartbeat",
            "bench_heartbeat",
            "event-loop lateness while 64 clients use AsyncTransformer",
            _heartbeat_argv,
            lambda o: "heartbeat_hf_cuda" if o.gpu else "heartbeat_hf",
        ),
    )
}


# ---- running -----------------------------------------------------------------------------


def child_env(options: argparse.Namespace) -> dict[str, str]:
    """The environment of a workload's process: offline, vLLM in-process, quiet vLLM logs."""
    env = dict(os.environ)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not options.gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_workload(workload: Workload, options: argparse.Namespace) -> dict[str, Any]:
    """Runs one workload's script, then plots its JSON; returns what the summary records."""
    from benchmarks.plots import plot

    command = [sys.executable, "-m", f"benchmarks.{workload.script}", *workload.argv(options)]
    print(f"\n=== {workload.name}: {workload.describe}\n$ {' '.join(command)}", flush=True)
    json_path = options.out_dir / f"{workload.json_name(options)}.json"
    json_path.unlink(missing_ok=True)  # never mistake an older run's file for this one's
    start = time.perf_counter()
    status = subprocess.run(command, check=False, cwd=REPO, env=child_env(options)).returncode
    seconds = time.perf_counter() - start
    record: dict[str, Any] = {
        "workload": workload.name,
        "command": command,
        "returncode": status,
        "seconds": seconds,
        "json": str(json_path),
    }
    if status != 0 or not json_path.is_file():
        record["error"] = f"exit status {status}" if status else f"{json_path.name} was not written"
        print(f"=== {workload.name} FAILED ({record['error']}) after {seconds:.1f} s", flush=True)
        return record
    payload = json.loads(json_path.read_text())
    png_path = json_path.with_suffix(".png")
    plot(workload.name, payload, png_path)
    record["png"] = str(png_path)
    record["headlines"] = headlines(workload.name, payload)
    print(
        f"=== {workload.name} done in {seconds:.1f} s: {json_path.name}, {png_path.name}",
        flush=True,
    )
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "workloads",
        nargs="*",
        metavar="WORKLOAD",
        help=f"all (default) or any of: {', '.join(WORKLOADS)}",
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke run of a few minutes on CPU"
    )
    parser.add_argument("--gpu", action="store_true", help="the scripts' GPU configurations (CUDA)")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        default=None,
        help="with --gpu: the tekken tokenizer folder of prepare_gpu_assets.py",
    )
    parser.add_argument(
        "--vocab-dir", type=Path, default=None, help="W3: pickled or raw vocabularies"
    )
    parser.add_argument(
        "--peer", type=Path, default=None, help="W1/W5: a folder holding genlm-backend 0.3.1"
    )
    parser.add_argument(
        "--out-dir", type=Path, default=SCRATCH_DIR,
        help="default: benchmark-out/ (git-ignored); benchmarks/results: the figures of record",
    )
    options = parser.parse_args(argv)
    unknown = sorted(set(options.workloads) - {"all", *WORKLOADS})
    if unknown:
        parser.error(f"unknown workloads {unknown}; known: all, {', '.join(WORKLOADS)}")
    if not options.workloads or "all" in options.workloads:
        options.workloads = list(WORKLOADS)
    needs_tokenizer = {"w1-vllm", "w2", "memory"} & set(options.workloads)
    if options.gpu and needs_tokenizer and options.tokenizer_dir is None:
        parser.error(f"--gpu needs --tokenizer-dir for {', '.join(sorted(needs_tokenizer))}")
    options.out_dir = options.out_dir.resolve()
    for name in ("tokenizer_dir", "vocab_dir", "peer"):
        if getattr(options, name) is not None:
            setattr(options, name, getattr(options, name).resolve())
    return options


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    options.out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records = [run_workload(WORKLOADS[name], options) for name in options.workloads]
    total = time.perf_counter() - start
    lines = [line for r in records for line in r.get("headlines", [])]
    print(
        f"\n=== summary ({'quick, ' if options.quick else ''}{total:.0f} s; ratio = ours / floor)"
    )
    print_table(
        lines, ["workload", "case", "ours", "floor", "unit", "ratio", "min", "max", "better"]
    )
    failed = [r["workload"] for r in records if "error" in r]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    path = write_json(
        "suite",
        {
            "quick": options.quick,
            "gpu": options.gpu,
            "seconds": total,
            "workloads": records,
            "headlines": lines,
        },
        options.out_dir,
    )
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
