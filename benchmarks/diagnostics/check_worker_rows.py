"""Rows of held sessions over worker processes against vLLM's own list of every token's
log-probability, on the same engine.

Lockstep contexts go on, step after step, with each row's second most likely token (so a
rank that did not force it would feed its shard another token); every row of a held
session is then compared with the row vLLM lists for the same context as a one-token
request (``logprobs=-1``), and with our own row of that context as a plain request.
Reports the largest absolute difference, over every token and over the tokens within 2 nats
of each row's likeliest, and whether the argmax agrees. Run on the GPU host with, e.g.,
``--engine-opt tensor_parallel_size=2 --engine-opt disable_custom_all_reduce=true``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.models import parse_opts, workload_model


def compare(ours: torch.Tensor, listed: torch.Tensor) -> dict:
    finite = torch.isfinite(listed)
    diff = (ours.float().cpu() - listed)[finite].abs()
    likely = listed >= listed.max() - 2.0  # the likeliest tokens (random weights: all near -log V)
    return {
        "max_abs": float(diff.max()),
        "max_abs_likely": float((ours.float().cpu() - listed)[likely].abs().max()),
        "same_argmax": int(ours.argmax()) == int(listed.argmax()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--contexts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    import vllm

    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts = workload_model(args.gpu, None, args.tokenizer_dir)
    opts.update(parse_opts(args.engine_opt), max_logprobs=-1)
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=opts)
    gen = torch.Generator().manual_seed(0)
    vocab = lm.vocab_size
    contexts = [
        torch.randint(0, vocab, (5 + 7 * i,), generator=gen).tolist() for i in range(args.contexts)
    ]

    async def lockstep() -> list[tuple[list[int], torch.Tensor]]:
        seen, now = [], contexts
        for _ in range(args.steps):
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in now))
            seen += [(c, r.cpu()) for c, r in zip(now, rows)]
            now = [c + [int(r.topk(2).indices[1])] for c, r in zip(now, rows)]
        return seen

    held = asyncio.run(lockstep())
    sessions = lm.stats()["sessions"]
    lm.close_sessions()
    lm.set_sessions(False)
    plain = lm.batch_next_token_logprobs_sync([c for c, _ in held]).cpu()
    params = vllm.SamplingParams(max_tokens=1, logprobs=-1, temperature=0.0, detokenize=False)
    outputs = lm.llm.generate([{"prompt_token_ids": c} for c, _ in held], params, use_tqdm=False)
    results = []
    for (context, row), mine, out in zip(held, plain, outputs):
        listed = torch.full((vocab,), float("-inf"))
        for token, logprob in out.outputs[0].logprobs[0].items():
            listed[token] = logprob.logprob
        results.append(
            {
                "len": len(context),
                "held_vs_listed": compare(row, listed),
                "plain_vs_listed": compare(mine, listed),
                "held_vs_plain": compare(row, mine),
            }
        )
    summary = {
        key: {
            "max_abs": max(r[key]["max_abs"] for r in results),
            "max_abs_likely": max(r[key]["max_abs_likely"] for r in results),
            "argmax_agree": sum(r[key]["same_argmax"] for r in results) / len(results),
        }
        for key in ("held_vs_listed", "plain_vs_listed", "held_vs_plain")
    }
    payload = {"engine_opts": opts, "sessions": sessions, "rows": len(results), "summary": summary}
    print(json.dumps(payload, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps({**payload, "per_row": results}, indent=1))
    lm.cleanup()


if __name__ == "__main__":
    main()
