"""The event loop's cost of one particle-step, with an engine that takes no time.

W1's particles each await ``next_token_logprobs`` every step, then draw their tokens. On a
GPU the engine's step is a few milliseconds, so what the loop spends per particle-step
(validation, batching, futures, waking the particle, the draw's bookkeeping) decides whether
N particles keep up with vLLM's own decode loop. This measures that cost alone: the backend
answers each batch from stored rows on its engine thread (as the vLLM backend does: the batch
goes to the engine thread, its rows come back through ``call_soon_threadsafe``), rows are
short (``--vocab``) so the draws' arithmetic is negligible. Variants: ``w1``, the workload of
record (``bench_smc_vllm.py``: one ``asyncio.gather`` a step, the user's sampler draws all
rows at once); ``race``, ``batched``, ``predraw``: each particle a coroutine of its own that
draws its token from its row (``benchmarks/particles.py``).

Reference: ``bare`` is the least any asyncio design can pay for the same shape, two awaited
futures per particle-step resolved in batches when the loop is idle, with no validation,
no batcher and no draw.

``--evict-mb M``: the engine thread writes every cache line of an M MiB buffer before it
answers each batch, as vLLM's own step does to the caches between two turns of the loop (on
the H100 host the loop's code ran ~4x slower inside W1 than in isolation). ``evict_us`` is
that write's own cost per particle-step, measured alone: subtract it from the variants'.

    python benchmarks/diagnostics/bench_loop.py [--steps 32] [--context 128] [--repeats 5] \\
        [--evict-mb 64]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

import torch

from benchmarks.bench_smc_vllm import UserSampler, smc
from benchmarks.common import print_table, summarise, write_json
from benchmarks.particles import ParticleDraws
from genlm_backend.llm.base import AsyncLM
from genlm_backend.llm.engine import ThreadedEngine


class InstantEngine(ThreadedEngine):
    """Answers every batch at once with stored rows, from its engine thread: views of one
    fresh ``[k, V]`` tensor, as the real backends hand out a batch's rows."""

    def __init__(self, vocab_size: int, evict_mb: int = 0):
        super().__init__("instant-engine")
        self.vocab_size = vocab_size
        self.rows = torch.randn(256, vocab_size).log_softmax(-1)
        # one a cache line
        self.evict_lines = torch.zeros(evict_mb * 2**20 // 8, dtype=torch.float64)[::8]

    def evict(self) -> None:
        if self.evict_lines.numel():
            self.evict_lines.add_(1.0)

    def evaluate(self, requests):  # as vLLM's: the loop hands the batch over, gets a future
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def evaluate():
            self.evict()
            # a fresh [k, V] block, as a model's
            block = self.rows[torch.arange(len(requests)) % 256]
            loop.call_soon_threadsafe(future.set_result, list(block.unbind(0)))

        self.thread.submit(evaluate)
        return future


def instant_lm(vocab_size: int, evict_mb: int = 0) -> AsyncLM:
    return AsyncLM(None, InstantEngine(vocab_size, evict_mb), batch_size=4096)


class _Batch:
    """A batch's rows, set on the engine thread; its future resolves with all of them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int):
        self.loop, self.future, self.results, self.left = (
            loop,
            loop.create_future(),
            [None] * size,
            size,
        )

    def set(self, i: int, row: torch.Tensor) -> None:
        self.results[i] = row
        self.left -= 1
        if self.left == 0:
            self.loop.call_soon_threadsafe(self.future.set_result, self.results)


async def lockstep(
    lm: AsyncLM, prompt: list[int], num_particles: int, num_steps: int, sampler: str
) -> None:
    if sampler == "w1":
        await smc(lm, prompt, num_particles, num_steps, UserSampler("w1", lm.vocab_size, seed=0))
        return
    # "predraw": the batched sampler as it runs on a GPU (a block's rows drawn at once).
    draws = ParticleDraws(sampler, seed=0)

    async def particle() -> None:
        context = list(prompt)
        for _ in range(num_steps):
            row = await lm.next_token_logprobs(context)
            context.append(await draws.draw(row))

    await asyncio.gather(*(particle() for _ in range(num_particles)))


async def bare(num_particles: int, num_steps: int) -> None:
    """Two futures per particle-step, resolved in batches once the loop has nothing else to do."""
    loop = asyncio.get_running_loop()
    waiting: list[asyncio.Future] = []

    def flush() -> None:
        if loop._ready:  # other callbacks first: the batch is not complete yet
            loop.call_soon(flush)
            return
        batch = waiting[:]
        waiting.clear()
        for future in batch:
            future.set_result(1)

    def ask() -> asyncio.Future:
        future = loop.create_future()
        waiting.append(future)
        if len(waiting) == 1:
            loop.call_soon(flush)
        return future

    async def particle() -> None:
        context = list(range(128))
        for _ in range(num_steps):
            await ask()
            context.append(await ask())

    await asyncio.gather(*(particle() for _ in range(num_particles)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--context", type=int, default=128, help="prompt length (tokens)")
    parser.add_argument(
        "--vocab", type=int, default=32, help="row length (short: the draws cost next to nothing)"
    )
    parser.add_argument(
        "--samplers",
        nargs="+",
        default=["w1", "race"],
        help="w1 (the workload of record), race, batched, predraw",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--evict-mb", type=int, default=0, help="MiB the engine writes before each batch"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lm = instant_lm(args.vocab, args.evict_mb)
    prompt = [random.Random(0).randrange(args.vocab) for _ in range(args.context)]
    rows = []
    for n in args.particles:
        variants = {"bare": lambda n=n: bare(n, args.steps)}
        for sampler in args.samplers:
            variants[sampler] = lambda sampler=sampler, n=n: lockstep(
                lm, prompt, n, args.steps, sampler
            )
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, make in variants.items():
                start = time.perf_counter()
                asyncio.run(make())
                times[name].append(time.perf_counter() - start)
        row = {"N": n, "T": args.steps}
        start = time.perf_counter()
        for _ in range(args.steps):
            lm.engine.evict()
        row["evict_us"] = (time.perf_counter() - start) * 1e6 / (n * args.steps)
        for name, seconds in times.items():
            summary = summarise(seconds[1:])
            per_step = 1e6 / (n * args.steps)
            row[f"{name}_us"] = summary["median_s"] * per_step
            row[f"{name}_us_min"] = summary["min_s"] * per_step
            row[f"{name}_us_max"] = summary["max_s"] * per_step
        rows.append(row)
    lm.cleanup()
    columns = ["N", "T"] + [c for c in rows[0] if c.endswith("_us")]
    print("microseconds per particle-step (median over repeats; min/max in the JSON)")
    print_table(rows, columns)
    print("wrote", write_json("loop_overhead", {"config": vars(args), "rows": rows}, args.out))


if __name__ == "__main__":
    main()
