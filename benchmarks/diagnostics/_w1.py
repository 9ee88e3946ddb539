"""What the W1/W5 diagnostics share: the workload of record (``bench_smc_vllm``), its flags
plus ``--micro``, its backend, and vLLM's own decode loop on that backend's engine."""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

from benchmarks.bench_smc_vllm import UserSampler, parse_args, smc
from benchmarks.common import write_json
from benchmarks.models import workload


def parse(argv: list[str]) -> argparse.Namespace:
    """``bench_smc_vllm``'s flags, plus ``--micro``: on a CPU, the one-layer 256-output model
    whose forward pass costs next to nothing (a step is then host-side work, as on a GPU)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--micro", action="store_true")
    known, rest = parser.parse_known_args(argv)
    args = parse_args(rest)
    args.micro = known.micro
    if args.micro and "--steps" not in rest:
        args.steps, args.prompt_len = 32, 128  # the GPU run's shape
    return args


def start(
    args: argparse.Namespace, before_model: Callable[[], None] = lambda: None
) -> tuple[Any, list[int]]:
    """The backend with the default constructor, as the workload builds it, and the prompt.
    ``before_model`` runs first (wrappers installed then reach the backend's batchers)."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts, prompt = workload(args, micro=args.micro)
    before_model()
    return AsyncVirtualLM.from_name(str(model_dir), engine_opts=opts), prompt


def run_ours(lm: Any, prompt: list[int], n: int, args: argparse.Namespace, workload: str) -> None:
    """One run of the workload (``"w1"`` or ``"w5"``) at ``n`` particles."""
    sampler = UserSampler(workload, lm.vocab_size, args.seed)
    asyncio.run(smc(lm, prompt, n, args.steps, sampler))


def run_floor(lm: Any, prompt: list[int], n: int, args: argparse.Namespace) -> None:
    """vLLM's own decode loop over the same forward passes, on the backend's engine."""
    from vllm import SamplingParams, TokensPrompt

    lm.close_sessions()  # llm.generate would wait for the parked sessions
    params = SamplingParams(
        max_tokens=args.steps, ignore_eos=True, temperature=1.0, detokenize=False
    )
    lm.llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False)


def kept_rows(
    lm: Any, prompt: list[int], n: int, args: argparse.Namespace, workload: str
) -> list[Any]:
    """Every step's rows of one seeded run of the workload, on the CPU (float32)."""
    import torch

    sampler, rows = UserSampler(workload, lm.vocab_size, args.seed), []

    async def program():
        contexts = [list(prompt) for _ in range(n)]
        for t in range(args.steps):
            step = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            rows.append(torch.stack([r.float() for r in step]).cpu())
            contexts = sampler.step(step, contexts, t)

    asyncio.run(program())
    return rows


def row_difference(lm: Any, prompt: list[int], n: int, args: argparse.Namespace, workload: str,
                   switch: Callable[[str], None], modes: tuple[str, str]) -> float:
    """After a warm-up run (the prompt's blocks then cached for both modes), one seeded run
    in each of ``modes`` from fresh sessions: the largest difference between their rows."""
    run_ours(lm, prompt, n, args, workload)
    kept = []
    for mode in modes:
        switch(mode)
        lm.close_sessions()
        kept.append(kept_rows(lm, prompt, n, args, workload))
    return max((a - b).abs().max().item() for a, b in zip(*kept))


def alternate(lm: Any, prompt: list[int], n: int, args: argparse.Namespace, workload: str,
              switch: Callable[[str], None], modes: tuple[str, str]) -> dict[str, list[float]]:
    """Walls of ``args.repeats`` runs in each of ``modes``, run by run in turn (the order
    reversed every other repeat); ``switch(mode)`` before each run."""
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    for repeat in range(args.repeats):
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            switch(mode)
            started = time.perf_counter()
            run_ours(lm, prompt, n, args, workload)
            walls[mode].append(time.perf_counter() - started)
    return walls


def write_rows(args: argparse.Namespace, prefix: str, rows: list[dict]) -> None:
    """With ``--out-dir``: the flags and ``rows`` as ``<prefix>_<gpu|cpu>.json`` (or
    ``--name``) there."""
    if args.out_dir is not None:
        name = args.name or f"{prefix}_{'gpu' if args.gpu else 'cpu'}"
        config = {k: v for k, v in vars(args).items() if k != "serve"}
        write_json(name, {"config": config, "rows": rows}, args.out_dir)


class CollectorClock:
    """Seconds this process spends in Python's collector, per generation (``gc.callbacks``)."""

    def __init__(self):
        self.seconds = [0.0, 0.0, 0.0]
        self.counts = [0, 0, 0]
        self._started = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self.counts[info["generation"]] += 1

    def close(self) -> None:
        gc.callbacks.remove(self)
