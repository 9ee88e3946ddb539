"""W1 on the Hugging Face backend: lockstep sequential importance sampling, against its floor.

Workload W1: N particles start from one prompt and take T steps in lockstep. At every step
each particle awaits ``AsyncTransformer.next_token_logprobs(its context)`` on its own (the
backend batches the N concurrent awaits) and samples its next token from the returned row,
on the device that row lives on. Sampling is by inverse CDF (cumulative sum of the
probabilities, one uniform draw from a shared seeded generator, ``searchsorted``): on the
CPU ``torch.multinomial`` takes ~3 ms per 32k-token row and would swamp everything else.

Floor: what a hand-written loop does for the same contexts: one plain batched forward pass
per step (the prompt once, then one token per particle) resumed from the previous step's
``DynamicCache``, a float32 log-softmax, one batched inverse-CDF draw and one copy of
the N tokens to the host per step (a sampler needs them there, as the backend does).

Both make T forward passes per run (the first one is the prompt) and start cold: the
backend's key/value trie is cleared before every run. Runs of the two alternate (after one
warm-up run of each), so that both see the same machine load. The backend runs with
``batch_size = N`` (so a step is one batch) and its default key/value memory bound.
Also reported, to see where the backend's time goes: ``engine_s`` (inside the engine call:
trie, forward pass, log-softmax), ``outside_engine_us_per_request`` (the rest of the same
run per request: the particles' draws and the backend's validation, batching, futures and
event loop; medians over runs of each run's wall less its own engine time, which lies inside
it) and ``sample_s`` (the N*T one-row samplings alone, timed on stored rows: a cost of W1's
sampling, not of the backend, measured apart, so not to be subtracted from the others).

The model is a random-weight Llama built from a config (no files are needed: W1 sends token
ids only, and the backend's tokenizer is a word-level one made in memory, ``id_tokenizer``),
or a local folder (``--model DIR``, with its tokenizer). Runs with torch, transformers, numpy
and cachetools, with the repository on ``PYTHONPATH``::

    python benchmarks/bench_w1_hf.py --device cpu                  # tiny model, ~2 minutes
    python benchmarks/bench_w1_hf.py --device cuda --preset llama-1b --out DIR
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import print_table, summarise, write_json
from benchmarks.particles import SAMPLERS, ParticleDraws, sample_rows, time_draws
from genlm_backend.llm.hf import AsyncTransformer

PRESETS: dict[str, dict[str, Any]] = {
    # A small model: a CPU run of every N finishes in about two minutes on two cores.
    "tiny": {
        "hidden": 256, "layers": 4, "heads": 8, "kv_heads": 4, "mlp": 768, "vocab": 32000,
        "dtype": "float32", "prompt_len": 64, "steps": 32,
    },
    # The GPU configuration of the issue: Llama-3.2-1B's shape, 1.24e9 parameters (tied
    # input and output embeddings), random weights.
    "llama-1b": {
        "hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 8, "mlp": 8192, "vocab": 131072,
        "dtype": "bfloat16", "prompt_len": 128, "steps": 32,
    },
}  # fmt: skip


@functools.cache
def id_tokenizer(vocab_size: int) -> Any:
    """A Hugging Face tokenizer made in memory whose token ``i`` is the word ``<i>``: for a
    random-weight model, whose programs send token ids only."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def build_tokenizer(args: argparse.Namespace, model: Any) -> Any:
    """The tokenizer of ``--model``, else :func:`id_tokenizer` of the model's vocabulary."""
    if args.model:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.model)
    return id_tokenizer(model.config.vocab_size)


def build_model(args: argparse.Namespace) -> Any:
    """A random-weight Llama from the flags, or the model in ``--model``, on ``--device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.mlp,
        max_position_embeddings=max(4096, args.prompt_len + args.steps),
        tie_word_embeddings=True,
    )
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialise directly in the target dtype, on the device
    try:
        with torch.device(args.device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


# ---- the workload ----------------------------------------------------------------------


async def _particle(
    lm: AsyncTransformer, prompt: list[int], num_steps: int, draws: ParticleDraws
) -> list[int]:
    context = list(prompt)
    for _ in range(num_steps):
        logprobs = await lm.next_token_logprobs(context)
        context.append(await draws.draw(logprobs))
    return context


def run_w1(
    lm: AsyncTransformer, prompt: list[int], num_particles: int, num_steps: int, seed: int,
    sampler: str = "cdf",
) -> list[list[int]]:
    lm.clear_kv_cache()
    draws = ParticleDraws(sampler, seed)

    async def main() -> list[list[int]]:
        return await asyncio.gather(
            *(_particle(lm, prompt, num_steps, draws) for _ in range(num_particles))
        )

    return asyncio.run(main())


def run_floor(
    model: Any, prompt: list[int], num_particles: int, num_steps: int, seed: int, device: str,
    sampler: str = "cdf",
) -> list[list[int]]:
    from transformers import DynamicCache

    from genlm_backend.llm.hf.kv_cache import cache_argument, returned_cache

    past = cache_argument(model)  # the keyword of this transformers (5.24 renamed it)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        cache = DynamicCache()
        ids = torch.tensor([prompt], device=device)
        out = model(input_ids=ids, **{past: cache}, use_cache=True, logits_to_keep=1)
        cache = returned_cache(out)
        cache.batch_repeat_interleave(num_particles)
        logprobs = out.logits[:, -1].float().log_softmax(-1).expand(num_particles, -1)
        sampled = []
        for step in range(num_steps):
            tokens = sample_rows(logprobs, generator, sampler)
            sampled.append(tokens.view(-1).tolist())
            if step == num_steps - 1:
                break
            out = model(input_ids=tokens, **{past: cache}, use_cache=True, logits_to_keep=1)
            cache = returned_cache(out)
            logprobs = out.logits[:, -1].float().log_softmax(-1)
    return [list(prompt) + [s[i] for s in sampled] for i in range(num_particles)]


def _sync(device: Any) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _seconds(fn: Any, device: str) -> float:
    gc.collect()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


# ---- main ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="default: tiny on cpu, llama-1b on cuda",
    )
    parser.add_argument(
        "--model", default=None, help="a local model folder instead of a random-weight Llama"
    )
    for name in ("hidden", "layers", "heads", "kv_heads", "mlp", "vocab", "prompt_len", "steps"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    parser.add_argument("--particles", default="1,8,64,256", help="comma-separated values of N")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampler", choices=SAMPLERS, default="cdf",
                        help="how particles and the floor draw tokens (see benchmarks.particles)")
    parser.add_argument(
        "--max-kv-cache-bytes",
        type=int,
        default=None,
        help="the backend's bound (default: its own)",
    )
    parser.add_argument(
        "--out", default=None, help="folder of the JSON result (default: benchmark-out/)"
    )
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset or ("llama-1b" if args.device == "cuda" else "tiny")]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.preset = args.preset or ("llama-1b" if args.device == "cuda" else "tiny")
    return args


def measure(
    model: Any, prompt: list[int], num_particles: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One row of the table: W1 and its floor for ``num_particles`` particles."""
    opts = (
        {} if args.max_kv_cache_bytes is None else {"max_kv_cache_bytes": args.max_kv_cache_bytes}
    )
    lm = AsyncTransformer(model, build_tokenizer(args, model), batch_size=max(num_particles, 1),
                          **opts)

    def backend() -> None:
        run_w1(lm, prompt, num_particles, args.steps, args.seed, args.sampler)

    def floor() -> None:
        run_floor(model, prompt, num_particles, args.steps, args.seed, args.device, args.sampler)

    try:
        for _ in range(args.warmup):
            backend()
            floor()
        before = lm.stats()
        wall_times, engine_times, floor_times = [], [], []
        for _ in range(args.repeats):  # interleaved, so that both see the same machine load
            engine_before = lm.stats()["evaluate_s"]
            wall_times.append(_seconds(backend, args.device))
            engine_times.append(lm.stats()["evaluate_s"] - engine_before)
            floor_times.append(_seconds(floor, args.device))
        after = lm.stats()
    finally:
        lm.cleanup()
    wall, floor_summary = summarise(wall_times), summarise(floor_times)
    vocab = model.get_output_embeddings().weight.shape[0]
    stored = torch.randn(num_particles, vocab, device=args.device).log_softmax(-1)
    sample_s = statistics.median(
        time_draws(stored, num_particles, args.steps, args.seed, args.sampler) for _ in range(2)
    )
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {
        "N": num_particles,
        "T": args.steps,
        "wall_s": wall["median_s"],
        "floor_s": floor_summary["median_s"],
        "ratio": wall["median_s"] / floor_summary["median_s"],
        "step_ms": 1e3 * wall["median_s"] / args.steps,
        "floor_step_ms": 1e3 * floor_summary["median_s"] / args.steps,
        "engine_s": statistics.median(engine_times),
        "sample_s": sample_s,
        # each run's time outside its own engine calls (which lie inside its wall time), per
        # request: the particles' draws, validation, batching, futures, the event loop
        "outside_engine_us_per_request": 1e6
        * statistics.median(w - e for w, e in zip(wall_times, engine_times))
        / (num_particles * args.steps),
        "forward_passes": (after["num_forward_passes"] - before["num_forward_passes"])
        // args.repeats,
        "kv_cache_mib": after["kv_cache_bytes"] / 2**20,
        "wall_times": wall_times,
        "engine_times": engine_times,
        "floor_times": floor_times,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model = build_model(args)
    num_params = sum(p.numel() for p in model.parameters())
    vocab = model.get_output_embeddings().weight.shape[0]
    prompt = torch.randint(
        0, vocab, (args.prompt_len,), generator=torch.Generator().manual_seed(args.seed)
    ).tolist()
    print(
        f"model: {num_params / 1e6:.1f}M parameters, {args.dtype}, vocab {vocab}, "
        f"on {args.device}; "
        f"prompt {args.prompt_len} tokens, T={args.steps}"
    )
    rows = []
    for num_particles in [int(n) for n in args.particles.split(",")]:
        row = measure(model, prompt, num_particles, args)
        rows.append(row)
        print(
            f"N={num_particles}: backend {row['wall_s']:.3f}s, floor {row['floor_s']:.3f}s, "
            f"ratio {row['ratio']:.2f}",
            flush=True,
        )
    print()
    print_table(
        rows,
        [
            "N",
            "T",
            "wall_s",
            "floor_s",
            "ratio",
            "step_ms",
            "floor_step_ms",
            "engine_s",
            "sample_s",
            "outside_engine_us_per_request",
            "forward_passes",
            "kv_cache_mib",
        ],
    )
    payload = {
        "description": "W1 lockstep SIS on AsyncTransformer vs one batched forward pass per step",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "num_parameters": num_params,
        "rows": rows,
    }
    path = write_json(f"w1_hf_{args.device}", payload, Path(args.out) if args.out else None)
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
