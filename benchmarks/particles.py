"""How W1's particles draw their next token from a log-probability row, shared by the vLLM
and Hugging Face W1 scripts, and the timing of those draws on their own.

Three exact samplers, all on the row's device: ``multinomial`` (``torch.multinomial``,
about 1 ms for a 32k row on one CPU core); ``cdf``, inverse-CDF sampling (``searchsorted``
of a uniform draw in the cumulative probabilities, about 70 us there, the CPU's cheapest);
``race``, the exponential race (``argmax p_i / E_i`` with ``E_i ~ Exp(1)``, the trick vLLM's
own sampler uses: four kernels, the fewest launches, which is what a per-row GPU draw pays for);
``batched``, the particles share a :class:`genlm_backend.sampling.TokenSampler`, so the draws
awaited in one step run as one exponential race over the stacked rows (one set of kernels and
one host copy per step instead of per particle); ``predraw``, the same with a block's rows
drawn at the first draw from one of them on every device (the GPU default; on a CPU it shows
what the rest of the workload costs when draws cost what they cost on a GPU).
"""

from __future__ import annotations

import asyncio
import time

import torch

from genlm_backend.sampling import TokenSampler

SAMPLERS = ("multinomial", "cdf", "race", "batched", "predraw")


class ParticleDraws:
    """How W1's particles draw: ``await draws.draw(row)`` with any of :data:`SAMPLERS`."""

    def __init__(self, sampler: str, seed: int, predraw: bool | None = None):
        self.sampler, self.seed = sampler, seed
        self.generator: torch.Generator | None = None
        if sampler == "predraw":
            sampler, predraw = "batched", True
        self.token_sampler = (
            TokenSampler(seed=seed, predraw=predraw) if sampler == "batched" else None
        )
        if self.token_sampler is not None:
            # what a particle would call: no wrapper coroutine
            self.draw = self.token_sampler.sample

    async def draw(self, row: torch.Tensor) -> int:
        if self.token_sampler is not None:
            return await self.token_sampler.sample(row)
        if self.generator is None or self.generator.device != row.device:
            self.generator = torch.Generator(device=row.device).manual_seed(self.seed)
        return int(sample_rows(row, self.generator, self.sampler))


def sample_rows(
    logprobs: torch.Tensor, generator: torch.Generator, sampler: str = "cdf"
) -> torch.Tensor:
    """One token id per row of ``logprobs`` (``[V]`` or ``[N, V]``), drawn on their device;
    shape ``[1]`` or ``[N, 1]``."""
    if sampler in ("race", "batched", "predraw"):
        noise = torch.empty_like(logprobs).exponential_(generator=generator)
        return torch.argmax(logprobs.exp().div_(noise), dim=-1, keepdim=True)
    probs = logprobs.exp()
    if sampler == "multinomial":
        return torch.multinomial(probs, 1, generator=generator)
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), device=cdf.device, generator=generator) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)


def time_draws(
    rows: torch.Tensor, num_particles: int, num_steps: int, seed: int, sampler: str
) -> float:
    """Seconds for N*T one-row draws as W1's particles make them (each ending in a host
    sync; with ``batched``, T batches of N awaited draws), on the stored ``rows [R, V]``
    (R >= N: particles sharing a row would draw it twice, which the pre-drawing sampler
    does through its slower batched path): a cost of the workload's sampling, not of a
    backend."""
    if sampler in ("batched", "predraw"):
        return _time_batched_draws(rows, num_particles, num_steps, seed, sampler)
    generator = torch.Generator(device=rows.device).manual_seed(seed)
    if rows.is_cuda:
        torch.cuda.synchronize(rows.device)
    start = time.perf_counter()
    for _ in range(num_steps):
        for i in range(num_particles):
            int(sample_rows(rows[i % rows.shape[0]], generator, sampler))
    return time.perf_counter() - start


def _time_batched_draws(
    rows: torch.Tensor, num_particles: int, num_steps: int, seed: int, sampler: str
) -> float:
    draws = ParticleDraws(sampler, seed)
    picked = [rows[i % rows.shape[0]] for i in range(num_particles)]

    async def steps() -> None:
        for _ in range(num_steps):
            # Each step's rows are a new block, as a model's step makes one (the version bump
            # makes the pre-drawing sampler draw the block afresh instead of falling back).
            rows[:1, :1].add_(0.0)
            await asyncio.gather(*(draws.draw(row) for row in picked))

    if rows.is_cuda:
        torch.cuda.synchronize(rows.device)
    start = time.perf_counter()
    asyncio.run(steps())
    return time.perf_counter() - start
