"""W6: genlm-control's SMC end to end on our backend, against genlm-backend 0.3.1 and vLLM's loop.

The run of issue 25, as a genlm-control user writes it (genlm-control 0.4.1)::

    llm = PromptedLLM.from_name(model, backend="vllm", engine_opts=OPTS, prompt_ids=prompt)
    smc = SMC(direct_token_sampler(llm))
    await smc(n_particles=N, ess_threshold=0.5, max_tokens=32)

with W1's model and prompt (``models.py``; ``bench_smc_vllm.py``). Each step every particle
awaits ``logw_next``; genlm-control's autobatcher turns the N calls into one
``batch_next_token_logprobs``; the particle draws its token from the row (Gumbel-max, torch)
and SMC resamples when the ESS falls under N/2. A run is 31 drawn tokens plus the forced EOS,
whose weight needs one more row: 32 forward passes over N contexts, as the floor's.

- **ours**: this package, served to genlm-control as ``genlm.backend`` by
  ``genlm_backend.install_genlm_alias()``.
- **peer** (``--peer DIR``): genlm-backend 0.3.1 installed in DIR (``pip install --no-deps
  --target DIR genlm_backend-0.3.1-*.whl``), first on the module path of its process.
- **floor**: vLLM's own loop, ``llm.generate`` of N copies of the prompt with
  ``max_tokens=32`` (``ignore_eos``), on a plain ``vllm.LLM``, as in W1.

genlm-control and the packages it needs that the environment lacks are installed apart,
``pip install --no-deps --target DIR`` (``--consumer-site DIR``, default ``.cache/w6site``);
each configuration's process puts DIR last on its module path. Every configuration runs in
a process of its own (one engine a process); one warm-up run, then ``--repeats`` runs
interleaved over N, each seeded (torch and numpy, the same seeds for ours and the peer).
A particle that draws EOS ends early and its run does less work (rare with random weights):
``early_eos_runs`` counts such runs. Where the tokenizer names no EOS (the GPU's tekken
folder) the model is read through a folder of links whose tokenizer names ``--eos-token``:
``PromptedLLM`` needs one. Reported per N: floor, ours and peer seconds (median, min, max),
``ratio`` = wall / floor, ``speedup_vs_peer`` = the peer's wall / ours (GPU target: >= 1.5
at N=256).

``--profile N``: two more runs of each configuration at N. ``sampled``: py-spy (``--py-spy``;
default the consumer site's ``bin/py-spy``) samples every thread from outside, idle samples
left out; each sample counts for the file of its innermost Python frame (a C function for
its caller): engine (vllm), backend (genlm_backend, genlm/backend), asyncio, consumer
(genlm/control, grammar, bytes, arsenal, this script), torch, other; by thread too. This is
the split to quote. ``cprofile``: the same grouping of cProfile's own times (C functions
charged to their callers, time blocked in waits apart); before Python 3.12 it sees the loop's
thread and ours' engine thread (as ``bench_smc_vllm.py``); on 3.12 one profiler sees every
thread through one call stack that interleaved threads corrupt: a sketch only.

CPU (the tiny fp32 Llama, 32k vocabulary)::

    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bench_genlm_control.py \\
        --particles 4 16 --repeats 3 --profile 16

GPU (the 1.2B bf16 Llama, tekken 131k; the consumer's wheels from ``.gpucarry/w6/``)::

    python benchmarks/bench_genlm_control.py --gpu --tokenizer-dir .gpu_assets/tekken \\
        --peer /tmp/peer --consumer-site /tmp/w6site --repeats 5 --profile 256
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the repo, for `benchmarks.common`

from benchmarks.bench_smc_vllm import time_floor
from benchmarks.common import print_table, report, run_child, summarise, write_json
from benchmarks.models import add_model_args, workload

CONFIGS = ("floor", "ours", "process", "peer")
CONSUMER_DISTS = ("genlm-control", "genlm-grammar", "genlm-bytes", "arsenal")


# ---- one configuration, in its own process ---------------------------------------------


def load_consumer(role: str, site: str) -> None:
    """Makes genlm-control importable: its site last on the path (it must shadow nothing);
    for ours, ``genlm.backend`` served by this package first."""
    if role in ("ours", "process"):
        import genlm_backend

        genlm_backend.install_genlm_alias()
    sys.path.append(site)


def build(role: str, setup: dict) -> Any:
    """The genlm-control potential on this role's backend (the user's own constructor)."""
    from genlm.control import PromptedLLM

    if role == "process":  # our engine in a process of its own
        from genlm_backend.llm.vllm import start_engine_process

        lm = start_engine_process(setup["model"], engine_opts=setup["opts"])
        return PromptedLLM(lm, prompt_ids=setup["prompt"])
    return PromptedLLM.from_name(setup["model"], backend="vllm", engine_opts=setup["opts"],
                                 prompt_ids=setup["prompt"])


def run_smc(smc: Any, n: int, args: argparse.Namespace, seed: int) -> tuple[float, int]:
    """One seeded SMC run of ``n`` particles: (seconds, particles that ended before max_tokens)."""
    import numpy as np
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)
    start = time.perf_counter()
    sequences = asyncio.run(
        smc(n_particles=n, ess_threshold=args.ess_threshold, max_tokens=args.max_tokens)
    )
    wall = time.perf_counter() - start
    return wall, sum(len(c) < args.max_tokens for c in sequences.contexts)


def time_smc(smc: Any, args: argparse.Namespace) -> dict[int, dict]:
    """Wall seconds of each N: one warm-up round, then ``repeats`` rounds interleaved over N."""
    walls: dict[int, list[float]] = {n: [] for n in args.particles}
    early: dict[int, int] = {n: 0 for n in args.particles}
    for repeat in range(args.repeats + 1):
        for n in args.particles:
            wall, ended = run_smc(smc, n, args, args.seed + repeat)
            if repeat:
                walls[n].append(wall)
                early[n] += ended > 0
    return {n: {"wall": summarise(walls[n]), "times": walls[n], "early_eos_runs": early[n]}
            for n in args.particles}


def profile_smc(role: str, smc: Any, lm: Any, n: int, args: argparse.Namespace) -> dict:
    """Profiled runs of SMC at ``n``: under cProfile, and sampled by py-spy."""
    if n not in args.particles:
        run_smc(smc, n, args, args.seed)  # warm-up at this size
    engine_thread = getattr(lm, "_engine_thread", None) if role == "ours" else None
    return profile(role, n, lambda: run_smc(smc, n, args, args.seed)[0], engine_thread, args)


def profile_floor(llm: Any, prompt: list[int], n: int, args: argparse.Namespace) -> dict:
    """Profiled runs of the floor's ``llm.generate`` at ``n`` (its engine core in this thread)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(
        max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, detokenize=False
    )
    prompts = [TokensPrompt(prompt_token_ids=prompt)] * n

    def run() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run()  # warm-up at this size
    return profile("floor", n, run, None, args)


def profile(
    role: str, n: int, run: Callable[[], float], engine_thread: Any, args: argparse.Namespace
) -> dict:
    """One run under cProfile (``cprofile``) and one sampled by py-spy (``sampled``)."""
    out = {"config": role, "N": n, "cprofile": cprofile_run(run, engine_thread)}
    if args.py_spy:
        out["sampled"] = sampled_run(run, args.py_spy)
    return out


def cprofile_run(run: Callable[[], float], engine_thread: Any) -> dict:
    profilers = [cProfile.Profile()]
    per_thread = sys.version_info < (3, 12) and hasattr(engine_thread, "submit")
    if per_thread:
        profilers.append(cProfile.Profile())
        engine_thread.submit(profilers[1].enable).result()
    profilers[0].enable()
    wall = run()
    profilers[0].disable()
    if per_thread:
        engine_thread.submit(profilers[1].disable).result()
    threads = (
        "all, interleaved"
        if sys.version_info >= (3, 12)
        else "loop and engine"
        if per_thread
        else "main"
    )
    return {"wall_profiled_s": wall, "threads": threads, **split(profilers)}


def sampled_run(run: Callable[[], float], py_spy: str, rate: int = 1000) -> dict:
    """One run while py-spy samples this process ``rate`` times a second without stopping
    it; an active sample counts 1/rate s for the group of its innermost Python frame."""
    import signal
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        spy = subprocess.Popen(
            [
                py_spy,
                "record",
                "--pid",
                str(os.getpid()),
                "--rate",
                str(rate),
                "--format",
                "raw",
                "--threads",
                "--full-filenames",
                "--nonblocking",
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)  # attached
        wall = run()
        spy.send_signal(signal.SIGINT)
        err = spy.communicate(timeout=120)[1].decode(errors="replace")
        if not raw.is_file():
            return {"error": err[-1000:]}
        lines = raw.read_text().splitlines()
    totals, threads, frames = dict.fromkeys(GROUPS[:-1], 0.0), {}, {}
    for line in lines:
        stack, _, count = line.rpartition(" ")
        thread, *stack = stack.split(";")
        if not stack:
            continue
        name, _, where = stack[-1].rpartition(" (")
        filename = where.rstrip(")").rsplit(":", 1)[0]
        seconds = int(count) / rate
        where_group = group(filename, name)
        totals[where_group] = totals.get(where_group, 0.0) + seconds
        thread_name = thread.split(": ", 1)[-1]
        by_thread = threads.setdefault(thread_name, {})
        by_thread[where_group] = round(by_thread.get(where_group, 0.0) + seconds, 4)
        frames[stack[-1]] = frames.get(stack[-1], 0.0) + seconds
    active = sum(totals.values()) or 1.0
    top = sorted(frames.items(), key=lambda kv: -kv[1])[:25]
    return {"wall_profiled_s": wall, "rate": rate, "active_s": round(active, 4),
            "split_s": {k: round(v, 4) for k, v in totals.items()},
            "share": {k: round(v / active, 3) for k, v in totals.items()}, "by_thread": threads,
            "top": [f"{s:.4f}s {frame.replace(str(REPO), '.')}" for frame, s in top]}


_WAITS = ("acquire", "poll", "select", "wait", "sleep", "'get' of '_queue", "join")
_GROUPS = (("engine", ("/vllm/",)), ("backend", ("/genlm_backend/", "/genlm/backend/")),
           ("consumer", ("/genlm/control/", "/genlm/grammar/", "/genlm/bytes/", "/arsenal/",
                         "bench_genlm_control")),
           ("asyncio", ("/asyncio/",)), ("torch", ("/torch/",)))
GROUPS = ("engine", "backend", "asyncio", "consumer", "torch", "other", "waiting")


def group(filename: str, name: str) -> str:
    """Where a profiled function lives; C functions (``~``) by their name: waits, the event
    loop's (its self-pipe socket too), torch's, the rest "other"."""
    if filename == "~":
        if any(w in name for w in _WAITS):
            return "waiting"
        if "asyncio" in name or "_socket.socket" in name:
            return "asyncio"
        return "torch" if "torch" in name else "other"
    return next((g for g, keys in _GROUPS if any(k in filename for k in keys)), "other")


def split(profilers: list[cProfile.Profile]) -> dict:
    """Own seconds by group over ``profilers``, a C function's (a torch kernel's) charged to
    its callers' groups; ``share``: of the time not spent waiting; the 25 heaviest functions."""
    stats = pstats.Stats(profilers[0])
    for prof in profilers[1:]:
        stats.add(prof)
    by_caller = dict.fromkeys(GROUPS, 0.0)
    for (filename, _, name), (_, _, own, _, callers) in stats.stats.items():
        where = group(filename, name)
        if filename != "~" or where == "waiting":
            by_caller[where] += own
            continue
        charged = 0.0
        for (c_file, _, c_name), (_, _, c_own, _) in callers.items():
            by_caller[group(c_file, c_name) if c_file != "~" else where] += c_own
            charged += c_own
        by_caller[where] += max(own - charged, 0.0)
    working = sum(v for k, v in by_caller.items() if k != "waiting") or 1.0
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
    return {"split_s": {k: round(v, 4) for k, v in by_caller.items()},
            "share": {k: round(v / working, 3) for k, v in by_caller.items() if k != "waiting"},
            "top": [f"{own:.4f}s own {calls} calls {Path(f).name}:{line} {name}"
                    for (f, line, name), (calls, _, own, _, _) in top]}


def versions(role: str) -> dict[str, str]:
    """The consumer's versions and which backend served ``genlm.backend``."""
    import importlib.metadata as md

    import genlm.backend

    out = {}
    for dist in CONSUMER_DISTS:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    if role in ("ours", "process"):
        import genlm_backend

        out["backend"] = f"genlm_backend {getattr(genlm_backend, '__version__', '?')} (this repo)"
    else:
        site = Path(genlm.backend.__file__).resolve().parents[2]
        dists = [
            d.version
            for d in md.distributions(path=[str(site)])
            if d.metadata["Name"] == "genlm_backend" or d.metadata["Name"] == "genlm-backend"
        ]
        out["backend"] = f"genlm-backend {dists[0] if dists else '?'} ({site})"
    return out


def serve(setup: str) -> None:
    """A child process: time one configuration, report its result to the parent."""
    setup = json.loads(setup)
    args, role = parse_args(setup["argv"]), setup["role"]
    if role == "floor":
        from vllm import LLM

        llm = LLM(setup["model"], **setup["opts"])
        floor_args = argparse.Namespace(
            steps=args.max_tokens, particles=args.particles, repeats=args.repeats
        )
        out = {
            "times": time_floor(llm, setup["prompt"], floor_args),
            "profile": [profile_floor(llm, setup["prompt"], n, args) for n in args.profile],
        }
        report(out)
        return
    load_consumer(role, setup["consumer_site"])
    from genlm.control import SMC, direct_token_sampler

    potential = build(role, setup)
    smc = SMC(direct_token_sampler(potential))
    out = {"versions": versions(role), "vocab": len(potential.vocab), "times": time_smc(smc, args),
           "profile": [profile_smc(role, smc, potential.model, n, args) for n in args.profile]}
    if hasattr(potential.model, "stats") and role in ("ours", "process"):
        out["stats"] = potential.model.stats()
    report(out, default=str)
    if hasattr(potential.model, "cleanup"):
        potential.model.cleanup()


def in_child(
    role: str, model_dir: Path, engine_opts: dict, prompt: list[int], args: argparse.Namespace
) -> dict:
    """Runs ``role`` alone in a child process; returns its result (JSON keys of N as ints)."""
    setup = {"role": role, "model": str(model_dir), "opts": engine_opts, "prompt": prompt,
             "consumer_site": str(Path(args.consumer_site).resolve()), "argv": sys.argv[1:]}
    env = dict(os.environ)
    for key, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("VLLM_NO_USAGE_STATS", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
    ):
        env.setdefault(key, value)
    if not args.gpu:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if role == "floor":  # its engine core in that process, as the backends' are
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if role == "peer":
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(args.peer).resolve()), env.get("PYTHONPATH")])
        )
    print(f"--- {role}", flush=True)
    result = run_child(__file__, setup, env, f"the {role}'s process")
    result["times"] = {int(n): v for n, v in result["times"].items()}
    return result


# ---- the run ------------------------------------------------------------------------------


def with_eos(model_dir: Path, eos: str) -> Path:
    """``model_dir``, or where its tokenizer has no EOS (the GPU's tekken folder), a sibling
    folder of links to it whose tokenizer names ``eos`` as its EOS: genlm-control's
    ``PromptedLLM`` indexes the vocabulary by ``tokenizer.eos_token_id`` whatever EOS it is
    given, and fails on None, on either backend. The floor ignores EOS."""
    from transformers import AutoTokenizer

    if AutoTokenizer.from_pretrained(str(model_dir)).eos_token_id is not None:
        return model_dir
    out = model_dir.with_name(f"{model_dir.name}_eos")
    out.mkdir(exist_ok=True)
    for path in model_dir.iterdir():
        if path.name != "tokenizer_config.json" and not (out / path.name).exists():
            (out / path.name).symlink_to(path.resolve())
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": eos}, indent=2))
    if AutoTokenizer.from_pretrained(str(out)).eos_token_id is None:
        sys.exit(f"{eos!r} is not a token of {model_dir}'s tokenizer (give --eos-token)")
    return out


def table(results: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in args.particles:
        floor = results["floor"]["times"][n]
        ours = results["ours"]["times"][n]
        row = {
            "N": n,
            "max_tokens": args.max_tokens,
            "floor_s": floor["median_s"],
            "floor_min_s": floor["min_s"],
            "floor_max_s": floor["max_s"],
            "wall_s": ours["wall"]["median_s"],
            "wall_min_s": ours["wall"]["min_s"],
            "wall_max_s": ours["wall"]["max_s"],
            "ratio": ours["wall"]["median_s"] / floor["median_s"],
            "early_eos_runs": ours["early_eos_runs"],
        }
        if "process" in results:
            process = results["process"]["times"][n]["wall"]
            row.update(process_wall_s=process["median_s"], process_wall_min_s=process["min_s"],
                       process_wall_max_s=process["max_s"],
                       process_speedup=ours["wall"]["median_s"] / process["median_s"])
        if "peer" in results:
            peer = results["peer"]["times"][n]
            row.update(
                peer_wall_s=peer["wall"]["median_s"],
                peer_wall_min_s=peer["wall"]["min_s"],
                peer_wall_max_s=peer["wall"]["max_s"],
                peer_ratio=peer["wall"]["median_s"] / floor["median_s"],
                speedup_vs_peer=peer["wall"]["median_s"] / ours["wall"]["median_s"],
                peer_early_eos_runs=peer["early_eos_runs"],
            )
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument(
        "--particles",
        type=int,
        nargs="+",
        default=None,
        help="default: 16 64 256 (GPU), 4 16 (CPU)",
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--ess-threshold", type=float, default=0.5)
    parser.add_argument(
        "--eos-token", default="</s>", help="EOS where the tokenizer names none (tekken: id 2)"
    )
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="default: 128 on GPU, 32 on CPU (W1's)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--peer", default=None, help="a folder holding genlm-backend 0.3.1")
    parser.add_argument("--engine-process", action="store_true",
                        help="also ours with the engine in a process of its own")
    parser.add_argument("--consumer-site", default=str(REPO / ".cache" / "w6site"),
                        help="a folder holding genlm-control 0.4.1 and its needs (pip --target)")
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="N")
    parser.add_argument(
        "--py-spy",
        default=None,
        help="py-spy for the sampled profile (default: the consumer "
        "site's bin/py-spy, else on PATH; 'none': cProfile alone)",
    )
    parser.add_argument(
        "--name", default=None, help="result file name (default: genlm_control_<gpu|cpu>)"
    )
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.particles = args.particles or ([16, 64, 256] if args.gpu else [4, 16])
    args.prompt_len = args.prompt_len or (128 if args.gpu else 32)
    if args.py_spy is None:
        local = Path(args.consumer_site) / "bin" / "py-spy"
        args.py_spy = str(local.resolve()) if local.is_file() else shutil.which("py-spy")
    elif args.py_spy == "none":
        args.py_spy = None
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve)
        return {}
    if not (Path(args.consumer_site) / "genlm" / "control").is_dir():
        sys.exit(
            f"no genlm-control under --consumer-site {args.consumer_site} "
            "(see benchmarks/README.md, W6)"
        )
    model_dir, engine_opts, prompt = workload(args)  # W1's model and prompt
    model_dir = with_eos(model_dir, args.eos_token)
    roles = [r for r in CONFIGS
             if (r != "peer" or args.peer) and (r != "process" or args.engine_process)]
    results, errors = {}, {}
    for role in roles:
        try:
            results[role] = in_child(role, model_dir, engine_opts, prompt, args)
        except RuntimeError as err:
            if role != "peer":
                raise
            errors[role] = str(err)[-3000:]  # recorded: the rest of the run goes on without it
            print(err, file=sys.stderr)
    roles = list(results)
    rows = table(results, args)
    print(f"\nW6 ({'GPU' if args.gpu else 'CPU'}; seconds, medians of {args.repeats})")
    print_table(rows, [c for c in rows[0] if not c.endswith(("_min_s", "_max_s"))])
    profile = [p for role in roles for p in results[role]["profile"]]
    for p in profile:
        for kind in ("sampled", "cprofile"):
            if kind in p and "split_s" in p[kind]:
                q = p[kind]
                print(
                    f"\nprofile {p['config']} N={p['N']} {kind} "
                    f"({q['wall_profiled_s']:.3f} s): {q['split_s']}"
                    f"\n  share: {q['share']}\n" + "\n".join(q["top"][:8])
                )
    payload = {
        "config": {**vars(args), "model_dir": str(model_dir), "engine_opts": engine_opts},
        "versions": {r: results[r]["versions"] for r in roles if r != "floor"},
        "errors": errors,
        "tables": {"w6": rows},
        "profile": profile,
        "stats": results["ours"].get("stats"),
        "times": {
            r: {n: results[r]["times"][n].get("times", []) for n in args.particles}
            for r in roles
            if r != "floor"
        },
    }
    name = args.name or f"genlm_control_{'gpu' if args.gpu else 'cpu'}"
    print("wrote", write_json(name, payload, args.out_dir))
    return payload


if __name__ == "__main__":
    main()
