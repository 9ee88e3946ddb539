"""A bound, not a backend: how fast W1 could run if vLLM's engine core ran in its own process,
so that the particles' Python overlaps the engine's host work instead of taking turns with
it at one GIL (as it must with the engine in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

One mode per process (run them in one call, for one machine):

- ``floor``: ``LLM.generate(N copies of the prompt, max_tokens=T)`` with the engine in this
  process: W1's floor of record.
- ``mp-floor``: the same N requests through ``AsyncLLM`` (engine core in a child process),
  each awaited to its end.
- ``mp-particles``: ``AsyncLLM`` again; N particle coroutines each receive their request's
  tokens one at a time (``RequestOutputKind.DELTA``) and do, per token, what a W1 particle
  does on the event loop with free-running sessions: the backend's check of its context
  (``PromptChecker.request``), a future resolved for it, and a draw from a row that carries
  the engine's token (``offer_draw``, ``TokenSampler.sample``).

What it leaves out is the rows. A backend built this way would keep them on the device, in
the engine core's process, and hand the event loop a slot of a ring of row buffers shared
once by CUDA IPC: the capture's cost on the engine side (0.2-0.7 ms per step in-process at
N = 64-256, ``trace_free.py``'s ``apply``) plus a slot number per row.

    python benchmarks/bound_mp.py --mode floor --gpu --tokenizer-dir DIR
    python benchmarks/bound_mp.py --mode mp-particles --gpu --tokenizer-dir DIR
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import model_for, parse_args, parse_opts, vocab_size  # noqa: E402

MODES = ("floor", "mp-floor", "mp-particles")


def engine_options(args: argparse.Namespace) -> tuple[Path, dict]:
    model_dir, opts = model_for(args)
    opts.update(parse_opts(args.engine_opt))
    return model_dir, {"model": str(model_dir), "seed": args.seed, "enable_prefix_caching": True,
                       "disable_log_stats": True, **opts}


def time_floor(opts: dict, prompt: list[int], args: argparse.Namespace) -> dict[int, list[float]]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(**opts)
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True, temperature=1.0, detokenize=False)
    times: dict[int, list[float]] = {}
    for n in args.particles:
        prompts = [TokensPrompt(prompt_token_ids=prompt)] * n
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.setdefault(n, []).append(time.perf_counter() - start)
    return times


async def time_mp(opts: dict, prompt: list[int], args: argparse.Namespace, particles: bool) -> dict[int, list[float]]:
    import torch
    from vllm import SamplingParams, TokensPrompt
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    from genlm_backend.llm.prompts import PromptChecker
    from genlm_backend.sampling import TokenSampler, offer_draw

    engine_args = AsyncEngineArgs(**{k: v for k, v in opts.items() if k != "disable_log_stats"},
                                  disable_log_stats=True)
    engine = AsyncLLM.from_engine_args(engine_args)
    kind = RequestOutputKind.DELTA if particles else RequestOutputKind.FINAL_ONLY
    params = SamplingParams(max_tokens=args.steps, ignore_eos=True, temperature=1.0, detokenize=False,
                            output_kind=kind)
    checker, sampler = PromptChecker(vocab_size(Path(opts["model"])), None), TokenSampler(seed=0)
    stubs = [torch.zeros(8) for _ in range(max(args.particles))]
    loop = asyncio.get_running_loop()
    runs = 0

    async def particle(i: int, tag: str) -> None:
        context = list(prompt)
        checker.request(context, None)
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"{tag}-{i}"):
            if not particles:
                continue
            for token in out.outputs[0].token_ids:
                future = loop.create_future()
                future.set_result(stubs[i])
                row = await future
                offer_draw(row, token)
                context.append(await sampler.sample(row))
                checker.request(context, None)

    times: dict[int, list[float]] = {}
    try:
        for n in args.particles:
            for repeat in range(args.repeats + 1):  # the first is a warm-up
                runs += 1
                start = time.perf_counter()
                await asyncio.gather(*(particle(i, f"r{runs}") for i in range(n)))
                if repeat:
                    times.setdefault(n, []).append(time.perf_counter() - start)
    finally:
        engine.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--out", type=Path, default=None, help="appends one JSON line")
    known, rest = parser.parse_known_args()
    args = parse_args(rest)
    model_dir, opts = engine_options(args)
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)]
    if known.mode == "floor":
        times = time_floor(opts, prompt, args)
    else:
        times = asyncio.run(time_mp(opts, prompt, args, particles=known.mode == "mp-particles"))
    result = {"mode": known.mode, "steps": args.steps,
              "seconds": {n: {"median": statistics.median(t), "min": min(t), "max": max(t)} for n, t in times.items()}}
    for n, t in result["seconds"].items():
        print(f"{known.mode:13s} N={n:4d}: median {t['median']:.4f} s (min {t['min']:.4f}, max {t['max']:.4f})")
    if known.out is not None:
        with known.out.open("a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
