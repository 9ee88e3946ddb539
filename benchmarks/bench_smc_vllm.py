"""W1 and W5 of record: what a user's SMC program does on AsyncVirtualLM, against vLLM's own loop.

N particles x T steps from one prompt. Every step each particle awaits
``next_token_logprobs(context)`` (one ``asyncio.gather`` a step, as a lockstep sampler does),
then the user's own sampler stacks the N rows on their device and draws with
``torch.multinomial``: one ``.tolist()`` a step. The backend is built with the default
constructor, ``AsyncVirtualLM.from_name(model, engine_opts=OPTS)``.

- **W1**: plain sequential importance sampling as above.
- **W5**: SMC with a constraint and resampling: before each draw a fixed half of the
  vocabulary is masked (``-inf``); every 4 steps the particles resample with random weights,
  so contexts fork (a particle takes a copy of its ancestor's context).

**Floor**: a plain ``vllm.LLM(model, **OPTS)`` alone on the machine (in a child process,
before ours starts: two engines with CUDA graphs cannot follow each other in one process),
``llm.generate(N copies of the prompt, SamplingParams(max_tokens=T,
ignore_eos=True, temperature=1.0, detokenize=False))``: the same forward passes in vLLM's
own decode loop with vLLM's own defaults, its engine core in that process as ours is in
this one (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for that child: vLLM's default core process
adds its messaging to every step); ``own_engine_floor_s`` is the same loop on our
engine (async scheduling off, the capture processor installed). **Peer** (``--peer DIR``):
genlm-backend 0.3.1, the library programs were written for, installed in ``DIR`` (``pip
install --no-deps --target DIR genlm_backend-0.3.1-*.whl``), run on the same workloads in a
child process (it sets vLLM environment variables at import).

Per configuration: one warm-up run, then ``--repeats`` runs, interleaved over N; medians
with min/max. ``ratio`` = wall / floor; ``ratio_nosample`` = (wall - the user's own
sampling time in that run, from when its rows are ready) / floor.

GPU (the 1.2B bf16 Llama of W1 with the 131k tekken vocabulary; ``prepare_gpu_assets.py``
first)::

    python benchmarks/bench_smc_vllm.py --gpu --tokenizer-dir .gpu_assets/tekken --peer /tmp/peer

CPU (the tiny fp32 Llama with Mistral's 32k tokenizer)::

    OMP_NUM_THREADS=1 python benchmarks/bench_smc_vllm.py --particles 1 8 64

``--profile N``: one more run of ours at N particles under cProfile on both the event loop's
thread and the engine thread, split by where the time is spent (``profile`` in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for `benchmarks.common`

import torch

from benchmarks.common import print_table, report, run_child, summarise, write_json
from benchmarks.models import add_model_args, workload

WORKLOADS = ("w1", "w5")
RESAMPLE_EVERY = 4


class UserSampler:
    """The user's own sampler: rows stacked on their device, ``torch.multinomial``, one
    ``.tolist()`` a step; W5 masks a fixed half of the vocabulary first and resamples the
    particles every ``RESAMPLE_EVERY`` steps. ``seconds`` adds up the time spent here."""

    def __init__(self, workload: str, vocab: int, seed: int):
        self.workload = workload
        self.generator = random.Random(seed)
        torch.manual_seed(seed)
        masked = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab // 2]
        self.mask = torch.zeros(vocab, dtype=torch.bool)
        self.mask[masked] = True
        self.seconds = 0.0

    def step(self, rows: list[torch.Tensor], contexts: list[list[int]], t: int) -> list[list[int]]:
        if rows and rows[0].is_cuda:  # the wait for rows still in the making is the backend's
            torch.cuda.synchronize(rows[0].device)
        start = time.perf_counter()
        logprobs = torch.stack([r.float() for r in rows])
        if self.workload == "w5":
            if self.mask.device != logprobs.device:
                self.mask = self.mask.to(logprobs.device)
            logprobs = logprobs.masked_fill(self.mask[: logprobs.shape[1]], float("-inf"))
        tokens = torch.multinomial(logprobs.softmax(-1), 1).squeeze(1).tolist()
        contexts = [c + [tok] for c, tok in zip(contexts, tokens)]
        if self.workload == "w5" and (t + 1) % RESAMPLE_EVERY == 0:
            weights = [self.generator.random() for _ in contexts]
            ancestors = self.generator.choices(
                range(len(contexts)), weights=weights, k=len(contexts)
            )
            contexts = [list(contexts[a]) for a in ancestors]
        self.seconds += time.perf_counter() - start
        return contexts


async def smc(
    lm: Any, prompt: list[int], n: int, steps: int, sampler: UserSampler
) -> list[list[int]]:
    contexts = [list(prompt) for _ in range(n)]
    for t in range(steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        contexts = sampler.step(rows, contexts, t)
    return contexts


def time_backend(
    lm: Any, prompt: list[int], args: argparse.Namespace, workload: str
) -> dict[int, dict]:
    """Wall and user-sampling seconds of each N (warm-up, then repeats interleaved over N)."""
    walls: dict[int, list[float]] = {n: [] for n in args.particles}
    samples: dict[int, list[float]] = {n: [] for n in args.particles}
    vocab = lm.vocab_size if hasattr(lm, "vocab_size") else len(lm.byte_vocab)
    for repeat in range(args.repeats + 1):
        for n in args.particles:
            sampler = UserSampler(workload, vocab, args.seed + repeat)
            start = time.perf_counter()
            asyncio.run(smc(lm, prompt, n, args.steps, sampler))
            wall = time.perf_counter() - start
            if repeat:  # the first round warms up
                walls[n].append(wall)
                samples[n].append(sampler.seconds)
    return {n: {"wall": summarise(walls[n]), "sample_s": sorted(samples[n])[len(samples[n]) // 2],
                "wall_nosample": summarise([w - s for w, s in zip(walls[n], samples[n])])}
            for n in args.particles}


def floor_call(llm: Any, prompt: list[int], n: int, steps: int) -> Any:
    """vLLM's own decode loop as a call: ``llm.generate`` of ``n`` copies of ``prompt``,
    ``steps`` tokens each (its arguments made here, outside any timing)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=1.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=prompt)] * n
    return lambda: llm.generate(prompts, params, use_tqdm=False)


def time_floor(llm: Any, prompt: list[int], args: argparse.Namespace) -> dict[int, dict]:
    """vLLM's own decode loop over the same forward passes on ``llm``."""
    calls = {n: floor_call(llm, prompt, n, args.steps) for n in args.particles}
    times: dict[int, list[float]] = {n: [] for n in args.particles}
    for repeat in range(args.repeats + 1):
        for n in args.particles:
            start = time.perf_counter()
            calls[n]()
            if repeat:
                times[n].append(time.perf_counter() - start)
    return {n: summarise(times[n]) for n in args.particles}


def profile_ours(
    lm: Any, prompt: list[int], n: int, args: argparse.Namespace, workload: str
) -> dict:
    """One run at ``n`` under cProfile: own time by where the code lives. On Python 3.12+
    one profiler sees every thread (``sys.monitoring``); before, the loop's thread and the
    engine thread get one each."""
    loop_prof, engine_prof = cProfile.Profile(), cProfile.Profile()
    per_thread = sys.version_info < (3, 12)
    if per_thread:
        lm.engine.thread.submit(engine_prof.enable).result()
    sampler = UserSampler(workload, lm.vocab_size, args.seed)
    loop_prof.enable()
    start = time.perf_counter()
    asyncio.run(smc(lm, prompt, n, args.steps, sampler))
    wall = time.perf_counter() - start
    loop_prof.disable()
    out = {
        "N": n,
        "workload": workload,
        "wall_profiled_s": wall,
        "threads": "loop" if per_thread else "all",
        "split": _split(loop_prof),
        "top": _top(loop_prof),
    }
    if per_thread:
        lm.engine.thread.submit(engine_prof.disable).result()
        out.update(engine_split=_split(engine_prof), engine_top=_top(engine_prof))
    return out


_WAITS = ("acquire", "poll", "select", "wait", "sleep")


def _group(filename: str, name: str) -> str:
    if filename == "~" and any(w in name for w in _WAITS):
        return "waiting"
    for key, group in (
        ("/genlm_backend/", "genlm_backend"),
        ("/vllm/", "vllm"),
        ("/torch/", "torch"),
        ("asyncio", "asyncio"),
        ("bench_smc_vllm", "user program"),
    ):
        if key in filename:
            return group
    return "builtins and other"


def _split(prof: cProfile.Profile) -> dict[str, float]:
    totals: dict[str, float] = {}
    for (filename, _, name), (_, _, own, _, _) in pstats.Stats(prof).stats.items():
        group = _group(filename, name)
        totals[group] = totals.get(group, 0.0) + own
    return {k: round(v, 4) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def _top(prof: cProfile.Profile, k: int = 25) -> list[str]:
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:k]
    return [
        f"{own:.4f}s own {calls} calls {Path(f).name}:{line} {name}"
        for (f, line, name), (calls, _, own, _, _) in rows
    ]


def run_ours(
    model_dir: Path, engine_opts: dict, prompt: list[int], args: argparse.Namespace,
    device: bool = False,
) -> dict:
    from genlm_backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=engine_opts)
    try:
        out = {w: time_backend(lm, prompt, args, w) for w in args.workloads}
        out["profile"] = [
            profile_ours(lm, prompt, n, args, w) for n in args.profile for w in args.workloads
        ]
        out["stats"] = lm.stats()
        if device:  # how busy the GPU is in a W1 run at the largest N
            n = max(args.particles)
            sampler = UserSampler("w1", lm.vocab_size, args.seed)
            out["device"] = device_busy(
                lambda: asyncio.run(smc(lm, prompt, n, args.steps, sampler))
            )
        # vLLM's loop on our own engine (async scheduling off, the capture installed)
        lm.close_sessions()
        out["own_engine_floor"] = time_floor(lm.llm, prompt, args)
    finally:
        lm.cleanup()
    return out


def in_child(
    role: str,
    model_dir: Path,
    engine_opts: dict,
    prompt: list[int],
    args: argparse.Namespace,
    path: str | None = None,
) -> dict:
    """Runs ``role`` ("floor" or "peer") alone in a child process (one engine with CUDA graphs
    a process); ``path`` goes first on its module path."""
    result = child_result(role, model_dir, engine_opts, prompt, sys.argv[1:], path)
    return {w: {int(n): v for n, v in r.items()} for w, r in result.items()}


def child_result(role: str, model_dir: Path, engine_opts: dict, prompt: list[int],
                 argv: list[str], path: str | None = None) -> dict[str, Any]:
    """What ``role`` ("floor", "ours" or "peer") reports from a child process of its own,
    started with this script's flags ``argv`` (as JSON: N keys are strings)."""
    setup = {"role": role, "model": str(model_dir), "opts": engine_opts, "prompt": prompt,
             "argv": argv}
    env = dict(os.environ)
    if role == "floor":  # its engine core in that process, as ours is in this one
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    return run_child(__file__, setup, env, f"the {role}'s process")


def device_busy(run: Any) -> dict[str, float] | None:
    """Runs ``run()`` once under torch's profiler: its wall, the time the GPU spent in
    kernels and copies meanwhile, and their ratio (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    device = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    return {"wall_s": wall, "device_s": device, "busy": device / wall}


def serve(setup: str) -> None:
    setup = json.loads(setup)
    args = parse_args(setup["argv"])
    if setup["role"] == "floor":
        from vllm import LLM

        llm = LLM(setup["model"], **setup["opts"])
        async_scheduling = bool(
            getattr(llm.llm_engine.vllm_config.scheduler_config, "async_scheduling", False)
        )
        out = {
            "floor": time_floor(llm, setup["prompt"], args),
            "async_scheduling": {0: async_scheduling},
        }
        n = max(args.particles)
        out["device"] = {0: device_busy(floor_call(llm, setup["prompt"], n, args.steps))}
    elif setup["role"] == "ours":
        report(run_ours(Path(setup["model"]), setup["opts"], setup["prompt"], args, device=True),
               default=str)
        return
    elif setup["role"] == "process":  # ours, the engine in a process of its own
        from genlm_backend.llm.vllm import start_engine_process

        lm = start_engine_process(setup["model"], engine_opts=setup["opts"])
        try:
            out = {w: time_backend(lm, setup["prompt"], args, w) for w in args.workloads}
            out["stats"] = lm.stats()
        finally:
            lm.cleanup()
        report(out, default=str)
        return
    else:
        from genlm.backend.llm import AsyncVirtualLM as PeerLM

        lm = PeerLM.from_name(setup["model"], engine_opts=setup["opts"])
        lm.vocab_size = len(lm.byte_vocab)
        out = {w: time_backend(lm, setup["prompt"], args, w) for w in args.workloads}
    report(out)


def table(
    floor: dict, ours: dict, peer: dict | None, args: argparse.Namespace
) -> dict[str, list[dict]]:
    tables = {}
    for w in args.workloads:
        rows = []
        for n in args.particles:
            f = floor["floor"][n]["median_s"]
            o = ours[w][n]
            row = {
                "N": n,
                "T": args.steps,
                "floor_s": f,
                "wall_s": o["wall"]["median_s"],
                "wall_min_s": o["wall"]["min_s"],
                "wall_max_s": o["wall"]["max_s"],
                "sample_s": o["sample_s"],
                "ratio": o["wall"]["median_s"] / f,
                "ratio_nosample": o["wall_nosample"]["median_s"] / f,
            }
            if peer is not None:
                p = peer[w][n]
                row.update(peer_wall_s=p["wall"]["median_s"], peer_ratio=p["wall"]["median_s"] / f,
                           peer_ratio_nosample=p["wall_nosample"]["median_s"] / f,
                           speedup_vs_peer=p["wall"]["median_s"] / o["wall"]["median_s"])
            row["own_engine_floor_s"] = ours["own_engine_floor"][n]["median_s"]
            rows.append(row)
        tables[w] = rows
    return tables


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(parser)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=None, help="T (default: 32 on GPU, 8 on CPU)")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="default: 128 on GPU, 32 on CPU"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--peer", default=None, help="a folder holding genlm-backend 0.3.1 (GPU)")
    parser.add_argument("--engine-process", action="store_true",
                        help="also ours with the engine in a process of its own (starts only)")
    parser.add_argument("--profile", type=int, nargs="*", default=[], metavar="N")
    parser.add_argument(
        "--name", default=None, help="result file name (default: smc_vllm_<gpu|cpu>)"
    )
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps or (32 if args.gpu else 8)
    args.prompt_len = args.prompt_len or (128 if args.gpu else 32)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.serve:
        serve(args.serve)
        return {}
    model_dir, engine_opts, prompt = workload(args)
    # each engine alone on the machine
    floor = in_child("floor", model_dir, engine_opts, prompt, args)
    # The children first: this process keeps the device memory its engine took.
    peer = in_child("peer", model_dir, engine_opts, prompt, args, args.peer) if args.peer else None
    ours = run_ours(model_dir, engine_opts, prompt, args)
    tables = table(floor, ours, peer, args)
    for w, rows in tables.items():
        print(f"\n{w.upper()} ({'GPU' if args.gpu else 'CPU'}; seconds, medians of {args.repeats})")
        print_table(rows, [c for c in rows[0] if not c.endswith(("_min_s", "_max_s"))])
    for p in ours["profile"]:
        print(f"\nprofile {p['workload']} N={p['N']} ({p['threads']} threads): {p['split']}")
        print("\n".join(p["top"][:15]))
    payload = {"config": {**vars(args), "model_dir": str(model_dir), "engine_opts": engine_opts,
                          "floor_async_scheduling": floor["async_scheduling"][0]},
               "tables": tables, "profile": ours["profile"], "stats": ours["stats"]}
    name = args.name or f"smc_vllm_{'gpu' if args.gpu else 'cpu'}"
    print("wrote", write_json(name, payload, args.out_dir))
    return payload


if __name__ == "__main__":
    main()
