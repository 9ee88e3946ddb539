"""Auto-batched sequential importance sampling on the embedded default model, offline.

N particles continue a prompt token by token. Each particle proposes its next token from
the model and is reweighted by a potential that penalises the letter "e" (a soft lipogram):
the target is ``p(x) * exp(-penalty * number of e's in x)``. Every particle awaits
``next_token_logprobs`` at every step; the backend turns the N concurrent awaits into one
batch. The same run is then repeated awaiting one particle at a time, to show what the
batching buys.

    python examples/demo.py [--backend vllm|hf|mock] [--particles 8] [--steps 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time

# This program's own choice, read by vLLM when it is imported: its INFO lines (dozens while
# an engine starts) would bury the result. Set VLLM_LOGGING_LEVEL=INFO to see them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch

from genlm_backend import load_model_by_name
from genlm_backend.llm.default_model import default_model_dir
from genlm_backend.llm.loading import is_vllm_usable

PROMPT = "Write one sentence about the sea."


def letter_e_counts(byte_vocab: list[bytes], size: int) -> torch.Tensor:
    counts = torch.zeros(size)
    for token_id, token in enumerate(byte_vocab):
        counts[token_id] = bytes(token).lower().count(b"e")
    return counts


async def particle(
    lm, prompt: list[int], steps: int, eos: set[int], penalty: torch.Tensor, seed: int, progress
):
    """One particle: returns (sampled token ids, log-weight)."""
    generator = torch.Generator().manual_seed(seed)
    context, sampled, log_weight = list(prompt), [], 0.0
    for step in range(steps):
        logprobs = await lm.next_token_logprobs(context)
        logprobs = logprobs.float().cpu()
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
        # Proposal = the model itself, so the incremental weight is the potential alone.
        log_weight -= float(penalty[token])
        progress(step)
        if token in eos:
            break
        sampled.append(token)
        context.append(token)
    return sampled, log_weight


async def run_sis(lm, prompt, steps, eos, penalty, num_particles, batched: bool):
    done = [0] * num_particles

    def progress_of(i):
        def tick(step):
            done[i] = step + 1
            total = sum(done)
            print(
                f"\r  {'batched' if batched else 'one at a time'}: {total} particle-steps",
                end="",
                file=sys.stderr,
            )

        return tick

    jobs = [
        particle(lm, prompt, steps, eos, penalty, seed=i, progress=progress_of(i))
        for i in range(num_particles)
    ]
    start = time.perf_counter()
    if batched:
        results = await asyncio.gather(*jobs)
    else:
        results = [await job for job in jobs]
    elapsed = time.perf_counter() - start
    print(file=sys.stderr)
    return results, elapsed


class ticking:
    """Prints ``what`` and the seconds elapsed, once a second, while the block runs."""

    def __init__(self, what: str):
        self.what, self.done = what, threading.Event()

    def __enter__(self) -> None:
        start = time.perf_counter()

        def tick() -> None:
            while not self.done.wait(1.0):
                print(
                    f"\r{self.what}: {time.perf_counter() - start:.0f} s",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )

        print(f"{self.what}...", end="", file=sys.stderr, flush=True)
        self.thread = threading.Thread(target=tick, daemon=True)
        self.thread.start()

    def __exit__(self, *exc_info) -> None:
        self.done.set()
        self.thread.join()
        print(file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["vllm", "hf", "mock"], default=None)
    parser.add_argument("--particles", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--penalty", type=float, default=2.0, help="log-weight lost per letter e")
    args = parser.parse_args()

    model_dir = str(default_model_dir())
    opts = {}
    if args.backend == "vllm" or (args.backend is None and is_vllm_usable()):
        opts = {"engine_opts": {"max_model_len": 512, "dtype": "float32"}}
    with ticking(
        "Loading SmolLM2-135M-Instruct "
        "(embedded, offline; vLLM compiles its kernels the first time)"
    ):
        lm = load_model_by_name(model_dir, backend=args.backend, llm_opts=opts or None)
    print(f"Backend: {type(lm).__name__}", file=sys.stderr)
    tokenizer = lm.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    eos = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    penalty = args.penalty * letter_e_counts(lm.byte_vocab, lm.vocab_size)

    async def both():
        batched, t_batched = await run_sis(
            lm, prompt, args.steps, eos, penalty, args.particles, True
        )
        stats = lm.stats()
        lm.clear_cache()
        _, t_single = await run_sis(lm, prompt, args.steps, eos, penalty, args.particles, False)
        return batched, t_batched, t_single, stats

    results, t_batched, t_single, stats = asyncio.run(both())
    log_weights = torch.tensor([w for _, w in results])
    weights = torch.softmax(log_weights, 0)
    print(
        f"\nPrompt: {PROMPT!r}   target: the model, penalised {args.penalty} nats per letter 'e'\n"
    )
    for (tokens, _), weight in sorted(zip(results, weights.tolist()), key=lambda r: -r[1]):
        print(f"  w={weight:6.3f}  {tokenizer.decode(tokens)!r}")
    ess = 1.0 / float((weights**2).sum())
    print(f"\nEffective sample size: {ess:.2f} of {args.particles}")
    print(f"Time, {args.particles} particles x {args.steps} steps:")
    print(f"  auto-batched (concurrent awaits): {t_batched:6.2f} s")
    print(f"  one request at a time:            {t_single:6.2f} s")
    print(f"  speed-up from batching:           {t_single / t_batched:6.2f}x")
    print(
        f"  batched run: {stats['num_batches']} engine batches, "
        f"mean size {stats['mean_batch_size']:.2f}"
    )
    lm.cleanup()


if __name__ == "__main__":
    main()
