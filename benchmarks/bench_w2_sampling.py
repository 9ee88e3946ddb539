"""W2: batched sampling throughput of AsyncVirtualLM, against vLLM's own ``llm.generate``.

P distinct prompts each get one sampled continuation of exactly T tokens (no end-of-sequence
id is passed, and vLLM is told to ignore its own EOS, so every run generates P*T tokens).
Our side is what a user of the contract writes: ``await lm.batch_sample(prompts, T, [],
seed=s)`` (variant ``batch_sample``) or P concurrent ``await lm.sample(prompt, T, [],
seed=s + i)`` (variant ``sample``); the backend's sampling batcher turns them into one
engine batch. The floor is vLLM's offline API over the same engine, in the same process:
``llm.generate(prompts, [SamplingParams(max_tokens=T, ignore_eos=True, temperature,
seed=s + i, detokenize=False)])``, the parameters our path builds for prompt i, so both
sample the very same tokens (``samples_match`` in the JSON). The backend runs with
``batch_size = P`` (a batch of P sampling requests is one engine call).

Reported per P: the median seconds (min/max) of each, tokens per second, and the ratio of
our tokens per second to the floor's (target >= 0.95): the floor's median time over ours,
with min/max over the pairs of interleaved runs. Runs alternate (after one warm-up run of
each), so that all see the same machine load. Also reported, to see where our time goes:
``<variant>_engine_s``, the seconds our engine thread spent in its ``engine.step()`` loop
(the floor's ``generate`` runs the same loop), and ``<variant>_outside_engine_s``, the rest
of the wall time (validation, building the parameters, queueing, futures, the event loop).

CPU (the tiny random Llama of ``models.py``, Mistral's 32k tokenizer)::

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \\
        python benchmarks/bench_w2_sampling.py

GPU (the random-weight 1.2B Llama of ``models.py``, tekken 131k vocabulary, bf16)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 \\
        python benchmarks/bench_w2_sampling.py --gpu --tokenizer-dir .gpu_assets/tekken
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for `benchmarks.common`

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import print_table, summarise, write_json
from benchmarks.models import TINY_CONFIG, add_model_args, build_model, parse_opts, workload_model

TARGET_RATIO = 0.95
VARIANTS = ("batch_sample", "sample")


def engine_opts_for(args: argparse.Namespace) -> dict[str, Any]:
    """The ``vllm.LLM`` options of W1's configurations (CPU tiny model or the GPU 1.2B one)."""
    if args.gpu:
        opts: dict[str, Any] = {"gpu_memory_utilization": 0.6, "max_model_len": 2048}
    else:
        opts = {"max_model_len": 512, "dtype": "float32"}
    opts["seed"] = args.seed
    opts.update(parse_opts(getattr(args, "engine_opt", ())))
    return opts


def model_dir_for(args: argparse.Namespace) -> Path:
    if args.gpu:
        return workload_model(True, args.model_dir, args.tokenizer_dir, size=args.size)[0]
    return build_model(
        Path(args.model_dir or "/tmp/w1_tiny_llama"), args.tokenizer_dir, TINY_CONFIG, torch.float32
    )


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num_prompts`` distinct random prompts (ids from 1000 up: no special tokens)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(1000, vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)
    ]


def floor_generate(
    llm: Any, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    """vLLM's own batch sampling with the parameters our path gives prompt i."""
    from vllm import SamplingParams, TokensPrompt

    params = [
        SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            temperature=temperature,
            seed=seed + i,
            detokenize=False,
            skip_special_tokens=False,
        )
        for i in range(len(prompts))
    ]
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    return [list(o.outputs[0].token_ids) for o in outputs]


def ours_batch_sample(
    lm: Any, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    return asyncio.run(lm.batch_sample(prompts, max_tokens, [], temperature=temperature, seed=seed))


def ours_sample(
    lm: Any, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int
) -> list[list[int]]:
    async def gather() -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(
                    lm.sample(p, max_tokens, [], temperature=temperature, seed=seed + i)
                    for i, p in enumerate(prompts)
                )
            )
        )

    return asyncio.run(gather())


def measure_config(lm: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    """One row: every variant and the floor on ``prompts``, warmed up once, interleaved."""
    llm = lm.llm
    lm.close_sessions()  # nothing of ours may hold engine slots while the floor runs
    run = {
        "batch_sample": lambda: ours_batch_sample(
            lm, prompts, args.max_tokens, args.temperature, args.seed
        ),
        "sample": lambda: ours_sample(lm, prompts, args.max_tokens, args.temperature, args.seed),
        "floor": lambda: floor_generate(llm, prompts, args.max_tokens, args.temperature, args.seed),
    }
    run = {name: fn for name, fn in run.items() if name == "floor" or name in args.variants}
    num_tokens, samples = {}, {}
    for name, fn in run.items():  # warm-up; also checks that every run makes P*T tokens
        samples[name] = fn()
        num_tokens[name] = sum(len(s) for s in samples[name])
        lm.close_sessions()
    times: dict[str, list[float]] = {name: [] for name in run}
    engine_times: dict[str, list[float]] = {name: [] for name in run if name != "floor"}
    for _ in range(args.repeats):
        for name, fn in run.items():
            engine_before = lm.stats()["engine"]["engine_s"]
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            # Results are handed over as each sequence finishes, so the engine thread may
            # still be closing its call: wait for it (close_sessions runs on it).
            lm.close_sessions()
            if name in engine_times:  # seconds our engine thread spent stepping vLLM
                engine_times[name].append(lm.stats()["engine"]["engine_s"] - engine_before)
    expected = len(prompts) * args.max_tokens
    row: dict[str, Any] = {"P": len(prompts), "T": args.max_tokens, "num_tokens": expected}
    floor = summarise(times["floor"])
    row["floor"] = {**floor, "times": times["floor"], "num_tokens": num_tokens["floor"]}
    row["floor_s"] = floor["median_s"]
    row["floor_tok_s"] = expected / floor["median_s"]
    for name in run:
        if name == "floor":
            continue
        stats = summarise(times[name])
        row[name] = {
            **stats,
            "times": times[name],
            "engine_times": engine_times[name],
            "num_tokens": num_tokens[name],
        }
        # where our time goes: inside the engine loop, and the rest (queueing, futures, loop)
        row[f"{name}_engine_s"] = statistics.median(engine_times[name])
        row[f"{name}_outside_engine_s"] = statistics.median(
            t - e for t, e in zip(times[name], engine_times[name])
        )
        row[f"{name}_s"] = stats["median_s"]
        row[f"{name}_tok_s"] = expected / stats["median_s"]
        # ours / floor in tokens per second (higher is better) = floor time / our time
        row[f"{name}_ratio"] = floor["median_s"] / stats["median_s"]
        # spread: the ratios of the interleaved runs, pair by pair
        paired = [f / t for f, t in zip(times["floor"], times[name])]
        row[f"{name}_ratio_min"], row[f"{name}_ratio_max"] = min(paired), max(paired)
    row["tokens_match"] = all(n == expected for n in num_tokens.values())
    # Same seeds, same parameters, same engine: the very same tokens as the floor's.
    row["samples_match"] = all(samples[name] == samples["floor"] for name in samples)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Builds the model and engine, measures every P, returns the JSON payload."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir = model_dir_for(args)
    engine_opts = engine_opts_for(args)
    lm = AsyncVirtualLM.from_name(
        str(model_dir), engine_opts=engine_opts, batch_size=max(args.prompts)
    )
    rows = []
    try:
        for num_prompts in args.prompts:
            prompts = make_prompts(num_prompts, args.prompt_len, lm.vocab_size, args.seed)
            row = measure_config(lm, prompts, args)
            rows.append(row)
            print(
                f"P={num_prompts} T={args.max_tokens}: floor {row['floor_tok_s']:.0f} tok/s, "
                + ", ".join(
                    f"{v} {row[f'{v}_tok_s']:.0f} tok/s ({row[f'{v}_ratio']:.3f}x)"
                    for v in VARIANTS
                    if f"{v}_ratio" in row
                ),
                flush=True,
            )
        stats = lm.stats()
    finally:
        lm.cleanup()
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "description": "W2 batched sampling: AsyncVirtualLM sample/batch_sample vs llm.generate",
        "config": {**config, "model_dir": str(model_dir), "engine_opts": engine_opts},
        "target_ratio": TARGET_RATIO,
        "rows": rows,
        "stats": stats,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument(
        "--prompts",
        type=int,
        nargs="+",
        default=None,
        help="values of P, distinct prompts per batch (default: 16 64 on CPU, 64 256 on GPU)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="T, tokens sampled per prompt")
    parser.add_argument(
        "--prompt-len", type=int, default=None, help="default: 128 on GPU, 32 on CPU"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument(
        "--engine-opt",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra vllm.LLM option (VALUE parsed as JSON when it can be); repeatable",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.prompts is None:
        args.prompts = [64, 256] if args.gpu else [16, 64]
    if args.prompt_len is None:
        args.prompt_len = 128 if args.gpu else 32
    if args.gpu and args.tokenizer_dir is None:
        parser.error("--gpu needs --tokenizer-dir (run benchmarks/prepare_gpu_assets.py)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    columns = ["P", "T", "floor_tok_s"]
    for v in args.variants:
        columns += [
            f"{v}_tok_s",
            f"{v}_ratio",
            f"{v}_ratio_min",
            f"{v}_ratio_max",
            f"{v}_outside_engine_s",
        ]
    print_table(result["rows"], columns + ["tokens_match", "samples_match"])
    name = "w2_sampling_gpu" if args.gpu else "w2_sampling_cpu"
    print("wrote", write_json(name, result, args.out_dir))
    return result


if __name__ == "__main__":
    main()
