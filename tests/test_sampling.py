"""TokenSampler: batched exact draws from log-probability rows.

The reference is the distribution itself: counts of many seeded draws against the row's
probabilities by a chi-square statistic (fixed seeds, so the test is deterministic; the bound
is the 1e-4 critical value, so an exact sampler fails it with probability 1e-4 per seed).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from genlm_backend.sampling import TokenSampler

# Chi-square critical values at p = 1e-4, by degrees of freedom.
CHI2_1E4 = {3: 21.11, 4: 23.51}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = probs > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


async def test_concurrent_draws_follow_the_row_and_run_as_one_batch():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    row = probs.log()
    sampler = TokenSampler(seed=1)
    counts = torch.zeros(6)
    for _ in range(20):
        tokens = await asyncio.gather(*(sampler.sample(row.clone()) for _ in range(1000)))
        counts += torch.bincount(torch.tensor(tokens), minlength=6)
    assert counts[5] == 0  # a -inf token is never drawn
    assert chi_square(counts, probs) < CHI2_1E4[4]
    assert sampler.stats.num_batches == 20 and sampler.stats.mean_batch_size == 1000


async def test_unnormalised_rows_and_rows_of_several_lengths_share_a_batch():
    sampler = TokenSampler(seed=2)
    short = torch.tensor([0.0, math.log(3.0)])  # p = 1/4, 3/4 once normalised
    long = torch.tensor([0.0, 0.0, 0.0, 0.0])
    draws = await asyncio.gather(*(sampler.sample(short if i % 2 else long) for i in range(4000)))
    short_counts = torch.bincount(torch.tensor(draws[1::2]), minlength=2).float()
    long_counts = torch.bincount(torch.tensor(draws[0::2]), minlength=4).float()
    assert chi_square(short_counts, torch.tensor([0.25, 0.75])) < 15.14  # df 1
    assert chi_square(long_counts, torch.full((4,), 0.25)) < CHI2_1E4[3]
    assert sampler.stats.num_batches == 1


async def test_same_seed_same_tokens():
    rows = [
        torch.randn(50, generator=torch.Generator().manual_seed(i)).log_softmax(-1)
        for i in range(30)
    ]

    async def draw_all(seed):
        sampler = TokenSampler(seed=seed)
        return await asyncio.gather(*(sampler.sample(r) for r in rows))

    assert await draw_all(7) == await draw_all(7)
    assert await draw_all(7) != await draw_all(8)


async def test_a_bad_row_fails_only_its_caller():
    sampler = TokenSampler(seed=3)
    good = torch.tensor([0.0, float("-inf")])
    dead = torch.full((2,), float("-inf"))
    results = await asyncio.gather(
        sampler.sample(good), sampler.sample(dead), sampler.sample(good), return_exceptions=True
    )
    assert results[0] == 0 and results[2] == 0
    assert isinstance(results[1], ValueError) and "-inf" in str(results[1])
    for bad in (torch.zeros(2, 3), torch.tensor([1, 2]), torch.zeros(0), [0.0, 1.0]):
        with pytest.raises(ValueError):
            await sampler.sample(bad)


def test_sample_now_draws_from_the_row():
    sampler = TokenSampler(seed=4)
    probs = torch.tensor([0.1, 0.6, 0.3])
    counts = torch.bincount(
        torch.tensor([sampler.sample_now(probs.log()) for _ in range(6000)]), minlength=3
    )
    assert chi_square(counts.float(), probs) < 18.42  # df 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_rows_on_the_gpu_are_drawn_there():
    sampler = TokenSampler(seed=5)
    probs = torch.tensor([0.7, 0.2, 0.1], device="cuda")
    tokens = await asyncio.gather(*(sampler.sample(probs.log()) for _ in range(6000)))
    counts = torch.bincount(torch.tensor(tokens), minlength=3).float()
    assert chi_square(counts, probs.cpu()) < 18.42


# ---- pre-drawn blocks: the rows of one model batch, views of one [k, V] tensor -------------

BLOCK_PROBS = torch.tensor([
    [0.5, 0.2, 0.15, 0.1, 0.05],
    [0.05, 0.05, 0.1, 0.3, 0.5],
    [0.2, 0.2, 0.2, 0.2, 0.2],
])


async def test_rows_of_a_block_are_drawn_at_once_and_follow_their_own_row():
    sampler = TokenSampler(seed=6, predraw=True)
    counts = torch.zeros(3, 5)
    for _ in range(3000):  # a fresh block per step, as a model hands out a batch's rows
        rows = BLOCK_PROBS.log().clone().unbind(0)
        tokens = [await sampler.sample(row) for row in rows]  # one at a time: no batch to join
        for i, token in enumerate(tokens):
            counts[i, token] += 1
    assert sampler.num_predrawn == 3 * 3000 and sampler.stats.num_batches == 0
    for i in range(3):
        assert chi_square(counts[i], BLOCK_PROBS[i]) < CHI2_1E4[4]


async def test_a_row_drawn_again_gets_a_fresh_draw():
    sampler = TokenSampler(seed=7, predraw=True)
    row = BLOCK_PROBS.log().clone().unbind(0)[0]
    tokens = [await sampler.sample(row) for _ in range(4000)]
    # Only the first draw is pre-drawn: the others are independent draws, not repeats of it.
    assert sampler.num_predrawn == 1
    counts = torch.bincount(torch.tensor(tokens), minlength=5).float()
    assert chi_square(counts, BLOCK_PROBS[0]) < CHI2_1E4[4]


async def test_a_block_changed_in_place_is_drawn_from_as_it_is_now():
    sampler = TokenSampler(seed=8, predraw=True)
    for _ in range(200):
        block = BLOCK_PROBS.log().clone()
        rows = block.unbind(0)
        first = await sampler.sample(rows[0])  # draws the block as it is
        # a constraint applied in place after that: only token 4 is left
        rows[1][:4] = float("-inf")
        assert await sampler.sample(rows[1]) == 4
        assert first in range(5)


async def test_views_that_are_not_whole_rows_are_drawn_on_their_own():
    sampler = TokenSampler(seed=9, predraw=True)
    inf = float("-inf")
    block = torch.tensor([[0.0, inf, inf], [inf, 0.0, inf]])
    assert await sampler.sample(block[1, 1:]) == 0  # the view [0.0, -inf]
    assert await sampler.sample(block[1, :2]) == 1  # the view [-inf, 0.0]
    assert await sampler.sample(block[:, 1]) == 1  # a column: [-inf, 0.0]
    assert sampler.num_predrawn == 0 and not sampler._blocks  # the block itself was never drawn


async def test_an_all_inf_row_in_a_block_fails_only_its_caller():
    sampler = TokenSampler(seed=10, predraw=True)
    block = torch.tensor(
        [[0.0, float("-inf")], [float("-inf"), float("-inf")], [float("-inf"), 0.0]]
    )
    rows = block.unbind(0)
    results = await asyncio.gather(*(sampler.sample(r) for r in rows), return_exceptions=True)
    assert results[0] == 0 and results[2] == 1
    assert isinstance(results[1], ValueError)


async def test_rows_on_the_cpu_are_not_pre_drawn_by_default():
    sampler = TokenSampler(seed=11)
    rows = BLOCK_PROBS.log().clone().unbind(0)
    await asyncio.gather(*(sampler.sample(r) for r in rows))
    assert sampler.num_predrawn == 0 and sampler.stats.num_batches == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_blocks_on_the_gpu_are_pre_drawn_by_default():
    sampler = TokenSampler(seed=12)
    counts = torch.zeros(3, 5)
    for _ in range(2000):
        rows = BLOCK_PROBS.log().to("cuda").unbind(0)
        for i, row in enumerate(rows):
            counts[i, await sampler.sample(row)] += 1
    assert sampler.num_predrawn == 3 * 2000
    for i in range(3):
        assert chi_square(counts[i], BLOCK_PROBS[i]) < CHI2_1E4[4]
