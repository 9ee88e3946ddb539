"""Sums and maxima below every node: sequential vs brute force, parallel vs sequential,
result types, and bad input.

Tolerances: the brute-force sums use ``math.fsum`` (exact rounding); the sequential trie
adds in float64 in a tree order, so its error is below ``1e-12`` times the sum of the
magnitudes below a node. The parallel trie adds in the input's dtype: the same bound for
float64, and ``1e-5`` times that sum for float32 (24-bit mantissa, tree depth < 40).
Maxima involve no rounding and must match exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings

import genlm_backend.trie.parallel as parallel_module
from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from tests.trie.paths import parallel_trie
from tests.trie.reference import reference
from tests.trie.strategies import vocab_and_weights

STRATEGIES = ["levels", "flat"]


@pytest.fixture(autouse=True)
def small_flat_stages(monkeypatch):
    """Stage-1 nodes of at most 2 tokens, so small vocabularies exercise several stages."""
    monkeypatch.setattr(parallel_module, "_FLAT_FANIN", 2)


def magnitude_below(trie, vocab, weights):
    return reference(trie, vocab, np.abs(weights), "sum")


def assert_sums_close(got, want, scale, rel):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    error = np.abs(got - want)
    bad = ~(error <= rel * scale)
    assert not bad.any(), f"nodes {np.flatnonzero(bad)}: got {got[bad]}, want {want[bad]}"


@settings(max_examples=120)
@given(vocab_and_weights())
def test_sequential_sum_matches_brute_force(case):
    vocab, ws = case
    trie = TokenCharacterTrie(vocab)
    assert_sums_close(
        trie.weight_sum(ws[0]),
        reference(trie, vocab, ws[0], "sum"),
        magnitude_below(trie, vocab, ws[0]),
        1e-12,
    )


@settings(max_examples=120)
@given(vocab_and_weights(log=True))
def test_sequential_max_matches_brute_force(case):
    vocab, ws = case
    trie = TokenCharacterTrie(vocab)
    np.testing.assert_array_equal(trie.weight_max(ws[0]), reference(trie, vocab, ws[0], "max"))


@settings(max_examples=60)
@given(vocab_and_weights(batch=3))
def test_parallel_sums_match_sequential(case):
    vocab, ws = case
    sequential = TokenCharacterTrie(vocab)
    want = sequential.batch_weight_sum(ws)
    scale = np.stack([magnitude_below(sequential, vocab, row) for row in ws])
    for strategy in STRATEGIES:
        trie = ParallelTokenCharacterTrie(vocab, strategy=strategy)
        assert_sums_close(trie.batch_weight_sum(torch.from_numpy(ws)), want, scale, 1e-12)
        assert_sums_close(trie.batch_weight_sum(ws), want, scale, 1e-12)
        ws32 = ws.astype(np.float32)  # compare with the sums of the rounded weights
        got32 = trie.batch_weight_sum(torch.from_numpy(ws32))
        assert got32.dtype == torch.float32
        assert_sums_close(got32, sequential.batch_weight_sum(ws32), scale, 1e-5)
        for row in range(len(ws)):  # batched == unbatched
            assert_sums_close(trie.weight_sum(ws[row]), want[row], scale[row], 1e-12)


@settings(max_examples=60)
@given(vocab_and_weights(batch=3, log=True))
def test_parallel_maxima_match_sequential_exactly(case):
    vocab, ws = case
    want = TokenCharacterTrie(vocab).batch_weight_max(ws)
    for strategy in STRATEGIES:
        trie = ParallelTokenCharacterTrie(vocab, strategy=strategy)
        np.testing.assert_array_equal(trie.batch_weight_max(torch.from_numpy(ws)).numpy(), want)
        np.testing.assert_array_equal(trie.batch_weight_max(ws), want)
        got32 = trie.batch_weight_max(torch.from_numpy(ws).float())
        np.testing.assert_array_equal(got32.numpy(), want.astype(np.float32))
        np.testing.assert_array_equal(trie.weight_max(ws[1]), want[1])


VOCAB = [b"a", b"ab", b"b", b"", b"ab"]
TRIES = [
    lambda v: TokenCharacterTrie(v),
    lambda v: ParallelTokenCharacterTrie(v, strategy="levels"),
    lambda v: ParallelTokenCharacterTrie(v, strategy="flat"),
    lambda v: ParallelTokenCharacterTrie(v, device="cpu"),  # the compiled kernel, if built
    lambda v: parallel_trie(v, "fallback", device="cpu"),
]


@pytest.mark.parametrize("make", TRIES)
@pytest.mark.parametrize(
    "ws, kind, dtype",
    [
        (np.ones(5, np.float32), np.ndarray, np.float64),
        (np.ones(5, np.int64), np.ndarray, np.float64),
        ([1, 1, 1, 1, 1], np.ndarray, np.float64),
        ((1.0,) * 5, np.ndarray, np.float64),
        (torch.ones(5), torch.Tensor, torch.float32),
        (torch.ones(5, dtype=torch.float64), torch.Tensor, torch.float64),
        (torch.ones(5, dtype=torch.float16), torch.Tensor, torch.float32),
        (torch.ones(5, dtype=torch.bfloat16), torch.Tensor, torch.float32),
        (torch.ones(5, dtype=torch.int64), torch.Tensor, torch.float32),
        (torch.ones(5, dtype=torch.bool), torch.Tensor, torch.float32),
        (torch.ones(5, requires_grad=True), torch.Tensor, torch.float32),
    ],
)
def test_result_types(make, ws, kind, dtype):
    trie = make(VOCAB)
    for method in (trie.weight_sum, trie.weight_max):
        out = method(ws)
        assert isinstance(out, kind) and out.dtype == dtype and out.shape == (trie.num_nodes,)
    assert trie.weight_sum(ws)[trie.root] == 5
    assert trie.weight_max(ws)[trie.root] == 1
    if kind is torch.Tensor:
        rows = torch.stack([ws.detach()] * 2)
    else:
        rows = np.stack([np.asarray(ws)] * 2)
    for method in (trie.batch_weight_sum, trie.batch_weight_max):
        out = method(rows)
        assert isinstance(out, kind) and out.dtype == dtype and out.shape == (2, trie.num_nodes)


@pytest.mark.parametrize("make", TRIES)
def test_log_weights_with_minus_infinity(make):
    trie = make(VOCAB)
    out = trie.weight_max(torch.tensor([-np.inf, -np.inf, -2.0, -np.inf, -np.inf]))
    assert out[trie.root] == -2.0
    a = trie.children[trie.root][ord("a")]
    assert out[a] == -np.inf
    assert torch.isneginf(out[trie.children[a][ord("b")]])


BAD_WEIGHTS = [
    (np.ones(4), InvalidRequestError, "4 weights"),
    (np.ones(6), InvalidRequestError, "6 weights"),
    (np.ones((1, 5)), InvalidRequestError, "dimension"),
    (np.float64(1.0), InvalidRequestError, "dimension"),
    (np.array([1.0, np.nan, 0, 0, 0]), InvalidRequestError, "NaN"),
    (torch.tensor([1.0, 0, 0, float("nan"), 0]), InvalidRequestError, "NaN"),
    (torch.ones(5, dtype=torch.complex64), InvalidRequestTypeError, "real"),
    (np.array(["a"] * 5), InvalidRequestTypeError, "real"),
    ([1, 2, "x", 4, 5], InvalidRequestTypeError, "real"),
    (None, InvalidRequestTypeError, "real"),
]


@pytest.mark.parametrize("make", TRIES)
@pytest.mark.parametrize("ws, error, words", BAD_WEIGHTS)
def test_bad_weights_raise_a_clear_error(make, ws, error, words):
    trie = make(VOCAB)
    for method in (trie.weight_sum, trie.weight_max):
        with pytest.raises(error, match=words):
            method(ws)


@pytest.mark.parametrize("make", TRIES)
def test_bad_batches_raise_a_clear_error(make):
    trie = make(VOCAB)
    for method in (trie.batch_weight_sum, trie.batch_weight_max):
        with pytest.raises(InvalidRequestError, match="dimension"):
            method(np.ones(5))
        with pytest.raises(InvalidRequestError, match="4 weights"):
            method(np.ones((2, 4)))
        with pytest.raises(ValueError, match="NaN"):
            method(torch.tensor([[0.0] * 5, [0, 0, 0, 0, float("nan")]]))


def test_unknown_strategy_and_device_are_rejected():
    with pytest.raises(ValueError, match="strategy"):
        ParallelTokenCharacterTrie(VOCAB, strategy="fast")
    with pytest.raises(RuntimeError):
        ParallelTokenCharacterTrie(VOCAB, device="no-such-device")


@pytest.mark.parametrize("make", TRIES)
def test_empty_batch(make):
    trie = make(VOCAB)
    assert trie.batch_weight_sum(torch.zeros(0, 5)).shape == (0, trie.num_nodes)
    assert trie.batch_weight_max(np.zeros((0, 5))).shape == (0, trie.num_nodes)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is absent")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ParallelTokenCharacterTrie(VOCAB, device="cuda")
