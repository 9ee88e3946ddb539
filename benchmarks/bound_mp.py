"""A bound, not a backend: how fast W1 could run if vLLM's engine core ran in its own process,
so that the particles' Python overlaps the engine's host work instead of taking turns with
it at one GIL (as it must with the engine in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

One process, three engines of the same model and options on one device (each with a third
of the memory share), and five variants alternated within each repeat, so that their ratios hold
on a machine whose speed moves between starts:

- ``floor``: ``LLM.generate(N copies of the prompt, max_tokens=T)`` with its engine in this
  process: W1's floor of record.
- ``mp-sync-floor``: the same ``LLM.generate`` on an engine whose core runs in a child
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``: this process only sends requests and turns
  the core's outputs into vLLM's request outputs).
- ``mp-floor``: the same N requests through ``AsyncLLM`` (engine core in a child process),
  each awaited to its end.
- ``mp-particles``: ``AsyncLLM`` again; N particle coroutines each receive their request's
  tokens one at a time (``RequestOutputKind.DELTA``) and do, per token, what a W1 particle
  does on the event loop with free-running sessions: the backend's check of its context
  (``PromptChecker.request``), a future resolved for it, and a draw from a row that carries
  the engine's token (``offer_draw``, ``TokenSampler.sample``).
- ``mp-particles+capture``: the same, with the engine core also writing every row's
  log-softmax into a ring of row buffers on the device (:mod:`benchmarks.ring_capture`):
  the engine side of a capture whose rows this process would map by CUDA IPC.

What it leaves out: this process copying each row out of the shared ring when its token
arrives, and the flow control a backend needs (the engine core here runs each request to
``max_tokens``; a session's caller may stop at any step).

    python benchmarks/bound_mp.py --gpu --tokenizer-dir DIR --engine-opt async_scheduling=true
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bound_mp.py --micro --particles 8 64
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
from benchmarks.ring_capture import RING_KEY  # noqa: E402

VARIANTS = ("floor", "mp-sync-floor", "mp-floor", "mp-particles", "mp-particles+capture")


class Engines:
    """The in-process engine, the engine in a child process, and W1's runs on each."""

    def __init__(self, opts: dict, prompt: list[int], steps: int, share: float | None):
        import torch
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM

        from genlm_backend.llm.prompts import PromptChecker
        from genlm_backend.sampling import TokenSampler

        memory = {} if share is None else {"gpu_memory_utilization": share}
        # The child process first: this one has not touched the device yet.
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            **opts, **memory, disable_log_stats=True, logits_processors=["benchmarks.ring_capture:RingCapture"]))
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        self.llm_mp = LLM(**opts, **memory, disable_log_stats=True)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = LLM(**opts, **memory, disable_log_stats=True)
        self.prompt = TokensPrompt(prompt_token_ids=prompt)
        self.context = list(prompt)
        base = {"max_tokens": steps, "ignore_eos": True, "temperature": 1.0, "detokenize": False}
        self.plain = SamplingParams(**base)
        self.final = SamplingParams(**base, output_kind=RequestOutputKind.FINAL_ONLY)
        self.delta = SamplingParams(**base, output_kind=RequestOutputKind.DELTA)
        self.captured = SamplingParams(**base, output_kind=RequestOutputKind.DELTA, extra_args={RING_KEY: 1})
        self.checker = PromptChecker(vocab_size(Path(opts["model"])), None)
        self.sampler = TokenSampler(seed=0)
        self.stub = torch.zeros(8)
        self.runs = 0

    async def run(self, variant: str, n: int) -> float:
        start = time.perf_counter()
        if variant in ("floor", "mp-sync-floor"):
            llm = self.llm if variant == "floor" else self.llm_mp
            llm.generate([self.prompt] * n, self.plain, use_tqdm=False)
        else:
            self.runs += 1
            params = {"mp-floor": self.final, "mp-particles": self.delta}.get(variant, self.captured)
            await asyncio.gather(*(self._particle(f"r{self.runs}-{i}", params) for i in range(n)))
        return time.perf_counter() - start

    async def _particle(self, request_id: str, params) -> None:
        from genlm_backend.sampling import offer_draw

        context, checker, sampler = list(self.context), self.checker, self.sampler
        checker.request(context, None)
        loop = asyncio.get_running_loop()
        async for out in self.engine.generate(self.prompt, params, request_id=request_id):
            if params is self.final:
                continue
            for token in out.outputs[0].token_ids:
                future = loop.create_future()
                future.set_result(self.stub)
                row = await future
                offer_draw(row, token)
                context.append(await sampler.sample(row))
                checker.request(context, None)

    def close(self) -> None:
        self.engine.shutdown()
        self.llm_mp.llm_engine.engine_core.shutdown()


async def alternate(engines, variants: tuple[str, ...], args) -> dict:
    """Times ``await engines.run(variant, n)`` for each N of ``args.particles``, the variants
    alternated within each repeat (after one warm-up each); ratios against ``variants[0]``.
    Closes the engines at the end."""
    rows = []
    try:
        for n in args.particles:
            for variant in variants:  # warm-up
                await engines.run(variant, n)
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.repeats):
                for variant in variants:
                    times[variant].append(await engines.run(variant, n))
            row = {"N": n, "T": args.steps}
            for variant, t in times.items():
                row[variant] = {"median": statistics.median(t), "min": min(t), "max": max(t)}
            base = variants[0]
            for variant in variants[1:]:
                ratios = [a / b for a, b in zip(times[variant], times[base])]
                row[f"{variant}/{base}"] = statistics.median(ratios)
            rows.append(row)
            print(f"N={n:4d}: " + ", ".join(f"{v} {row[v]['median']:.4f} s" for v in variants)
                  + f"; / {base}: " + ", ".join(f"{row[f'{v}/{base}']:.2f}" for v in variants[1:]), flush=True)
    finally:
        engines.close()
    return {"steps": args.steps, "repeats": args.repeats, "rows": rows}


def setup() -> tuple[Path | None, argparse.Namespace, Path, dict, float | None, list[int]]:
    """The command line: ``--out`` and W1's flags; the model folder, the engine options
    (without the memory share), the memory share of the workload, and W1's prompt."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--out", type=Path, default=None, help="writes the JSON here")
    known, rest = parser.parse_known_args()
    args = parse_args(rest)
    model_dir, opts = model_for(args)
    opts.update(parse_opts(args.engine_opt))
    share = opts.pop("gpu_memory_utilization", None)
    opts = {"model": str(model_dir), "seed": args.seed, "enable_prefix_caching": True, **opts}
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)]
    return known.out, args, model_dir, opts, share, prompt


def run_bound(make_engines, variants: tuple[str, ...], num_engines: int) -> None:
    """A bound's command line: ``make_engines(opts, prompt, steps, share)`` (on the event
    loop, each engine with ``1 / num_engines`` of the memory share), timed by
    :func:`alternate`; ``--out`` gets the JSON."""
    out, args, _model_dir, opts, share, prompt = setup()
    share = None if share is None else share / num_engines

    async def measure() -> dict:
        return await alternate(make_engines(opts, prompt, args.steps, share), variants, args)

    result = asyncio.run(measure())
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


def main() -> None:
    run_bound(Engines, VARIANTS, 3)


if __name__ == "__main__":
    main()
