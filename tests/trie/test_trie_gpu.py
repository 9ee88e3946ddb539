"""The parallel and async tries on CUDA devices (skipped where torch sees no GPU).

Tolerance: float32 sums on the GPU add in another order than the float64 sequential
trie (and atomics make that order vary run to run): ``1e-5`` of the magnitude below a
node. Maxima are exact.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from genlm_backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)
from tests.trie.strategies import vocab_and_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def devices():
    return (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )


@settings(max_examples=30)
@given(vocab_and_weights(batch=3, log=True))
def test_cuda_matches_sequential(case):
    vocab, logws = case
    sequential = TokenCharacterTrie(vocab)
    probs = np.exp(logws)
    want_sum, want_max = sequential.batch_weight_sum(probs), sequential.batch_weight_max(logws)
    scale = want_sum  # probabilities are non-negative: the magnitude is the sum itself
    for strategy in ("levels", "flat", "auto"):
        trie = ParallelTokenCharacterTrie(vocab, device="cuda", strategy=strategy)
        got = trie.batch_weight_sum(torch.from_numpy(probs).float().cuda())
        assert got.is_cuda and got.dtype == torch.float32
        assert np.all(np.abs(got.cpu().numpy() - want_sum) <= 1e-5 * scale + 1e-30)
        got_max = trie.batch_weight_max(torch.from_numpy(logws).cuda())
        np.testing.assert_array_equal(got_max.cpu().numpy(), want_max)


@pytest.mark.parametrize("device", devices())
def test_results_stay_on_the_input_device(device):
    vocab = [b"a", b"ab", b"b"]
    follow = ParallelTokenCharacterTrie(vocab)  # device=None: compute where the input is
    pinned = ParallelTokenCharacterTrie(vocab, device=device)
    ws = torch.tensor([0.2, 0.3, 0.5], device=device)
    for trie in (follow, pinned):
        out = trie.weight_sum(ws)
        assert out.device == ws.device and out[trie.root].item() == pytest.approx(1.0)
        assert isinstance(trie.weight_max(ws.cpu().numpy()), np.ndarray)
    cpu_out = pinned.weight_sum(ws.cpu())  # computed on the GPU, returned on the CPU
    assert cpu_out.device.type == "cpu"
    seq = TokenCharacterTrie(vocab).weight_max(ws)
    assert seq.device == ws.device


def test_async_on_cuda():
    vocab = [b"a", b"ab", b"b", b"\xc3\xa9"]
    ws = torch.softmax(torch.randn(8, len(vocab), device="cuda"), dim=-1)

    async def run():
        async with AsyncTokenCharacterTrie.from_vocab(vocab, device="cuda") as trie:
            return await asyncio.gather(*[trie.weight_sum(row) for row in ws])

    results = asyncio.run(run())
    assert all(r.is_cuda for r in results)
    torch.testing.assert_close(torch.stack(results)[:, 0], torch.ones(8, device="cuda"))
