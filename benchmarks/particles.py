"""How W1's particles draw their next token from a log-probability row, shared by the vLLM
and Hugging Face W1 scripts, and the timing of those draws on their own.

Three exact samplers, all on the row's device: ``multinomial`` (``torch.multinomial``,
about 1 ms for a 32k row on one CPU core); ``cdf``, inverse-CDF sampling (``searchsorted``
of a uniform draw in the cumulative probabilities, about 70 us there, the CPU's cheapest);
``race``, the exponential race (``argmax p_i / E_i`` with ``E_i ~ Exp(1)``, the trick vLLM's
own sampler uses: four kernels, the fewest launches, which is what a per-row GPU draw pays for).
"""

from __future__ import annotations

import time

import torch

SAMPLERS = ("multinomial", "cdf", "race")


def sample_rows(logprobs: torch.Tensor, generator: torch.Generator, sampler: str = "cdf") -> torch.Tensor:
    """One token id per row of ``logprobs`` (``[V]`` or ``[N, V]``), drawn on their device;
    shape ``[1]`` or ``[N, 1]``."""
    if sampler == "race":
        noise = torch.empty_like(logprobs).exponential_(generator=generator)
        return torch.argmax(logprobs.exp().div_(noise), dim=-1, keepdim=True)
    probs = logprobs.exp()
    if sampler == "multinomial":
        return torch.multinomial(probs, 1, generator=generator)
    cdf = probs.cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), device=cdf.device, generator=generator) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)


def time_draws(rows: torch.Tensor, num_particles: int, num_steps: int, seed: int, sampler: str) -> float:
    """Seconds for N*T one-row draws as W1's particles make them (each ending in a host
    sync), on the stored ``rows [R, V]``: a cost of the workload's sampling, not of a backend."""
    generator = torch.Generator(device=rows.device).manual_seed(seed)
    if rows.is_cuda:
        torch.cuda.synchronize(rows.device)
    start = time.perf_counter()
    for _ in range(num_steps):
        for i in range(num_particles):
            int(sample_rows(rows[i % rows.shape[0]], generator, sampler))
    return time.perf_counter() - start
