"""The CPU paths of ``ParallelTokenCharacterTrie``: the compiled kernel and the fallback,
each against the brute-force reference, and the kernel's own checks of its arguments.

Tolerances (as in ``test_trie_weights.py``): float64 sums within ``1e-12`` times the sum
of the magnitudes below a node (the reference is exactly rounded, the tries add in a tree
order); float32 sums within ``1e-5`` of that (24-bit mantissa, tree depth < 40), compared
with the sums of the rounded weights; maxima exact.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from genlm_backend.trie import TokenCharacterTrie, _compiled
from tests.trie.paths import CPU_PATHS, KERNEL_BUILT, parallel_trie
from tests.trie.reference import reference
from tests.trie.strategies import vocab_and_weights

# More rows than the fallback runs on its numpy kernels (4), and an odd count, so rows
# split unevenly between two threads.
NUM_ROWS = 5


def test_kernel_was_built_where_required():
    """CI sets ``GENLM_REQUIRE_TRIE_KERNEL=1``: a silently skipped build fails here."""
    if os.environ.get("GENLM_REQUIRE_TRIE_KERNEL") == "1":
        assert KERNEL_BUILT, (
            "genlm_backend.trie._kernel did not import: the optional C extension was not "
            "built (is a C compiler installed? rerun `pip install -e .` and read its log)"
        )
    elif not KERNEL_BUILT:
        pytest.skip("the compiled trie kernel was not built")


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def num_threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_sums_close(got, want, scale, rel):
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    bad = ~(np.abs(got - want) <= rel * scale)
    assert not bad.any(), f"nodes {np.flatnonzero(bad)}: got {got[bad]}, want {want[bad]}"


@pytest.mark.parametrize("path", CPU_PATHS)
@settings(max_examples=60, deadline=None)
@given(case=vocab_and_weights(batch=NUM_ROWS))
def test_sums_match_brute_force(path, case):
    vocab, ws = case
    trie = parallel_trie(vocab, path)
    want = np.stack([reference(trie, vocab, row, "sum") for row in ws])
    scale = np.stack([reference(trie, vocab, np.abs(row), "sum") for row in ws])
    assert_sums_close(trie.batch_weight_sum(torch.from_numpy(ws)), want, scale, 1e-12)
    assert_sums_close(trie.batch_weight_sum(ws[:1]), want[:1], scale[:1], 1e-12)
    assert_sums_close(trie.weight_sum(ws[2]), want[2], scale[2], 1e-12)
    ws32 = ws.astype(np.float32)
    got32 = trie.batch_weight_sum(torch.from_numpy(ws32))
    assert got32.dtype == torch.float32
    want32 = TokenCharacterTrie(vocab).batch_weight_sum(ws32)
    assert_sums_close(got32, want32, scale, 1e-5)


@pytest.mark.parametrize("path", CPU_PATHS)
@settings(max_examples=60, deadline=None)
@given(case=vocab_and_weights(batch=NUM_ROWS, log=True))
def test_maxima_match_brute_force_exactly(path, case):
    vocab, ws = case
    ws[1] = -np.inf  # a row of log-weights that are all -inf
    ws[2] = -np.abs(ws[2]) - 1.0  # all negative
    trie = parallel_trie(vocab, path)
    want = np.stack([reference(trie, vocab, row, "max") for row in ws])
    np.testing.assert_array_equal(trie.batch_weight_max(torch.from_numpy(ws)).numpy(), want)
    np.testing.assert_array_equal(trie.batch_weight_max(ws), want)
    np.testing.assert_array_equal(trie.weight_max(ws[2]), want[2])
    got32 = trie.batch_weight_max(torch.from_numpy(ws).float())
    np.testing.assert_array_equal(got32.numpy(), want.astype(np.float32))


@pytest.mark.parametrize("path", CPU_PATHS)
def test_threads_do_not_change_results(path, num_threads):
    vocab = [b"a", b"ab", b"abc", b"b", b"", b"ba", b"abd", b"ab"]
    rng = np.random.default_rng(num_threads)
    ws = torch.from_numpy(rng.normal(size=(7, len(vocab))))
    trie = parallel_trie(vocab, path)
    sequential = TokenCharacterTrie(vocab)
    want_sum = sequential.batch_weight_sum(ws).numpy()
    np.testing.assert_allclose(trie.batch_weight_sum(ws).numpy(), want_sum, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(
        trie.batch_weight_max(ws).numpy(), sequential.batch_weight_max(ws).numpy()
    )


@pytest.mark.parametrize("path", CPU_PATHS)
def test_inputs_that_are_not_dense_float_tensors(path):
    vocab = [b"a", b"ab", b"b"]
    trie = parallel_trie(vocab, path)
    sequential = TokenCharacterTrie(vocab)
    base = torch.tensor([[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]], dtype=torch.float64)
    strided = torch.zeros(2, 6, dtype=torch.float64)[:, ::2]
    strided.copy_(base)
    for ws, dtype in [
        (strided, torch.float64),  # rows not dense
        (base.T.contiguous().T, torch.float64),  # column-major
        (base[:1].expand(3, 3), torch.float64),  # one row, repeated by a zero stride
        ((-base)._neg_view(), torch.float64),  # a lazily negated view
        (base.to(torch.int64), torch.float32),
        (base.to(torch.float16), torch.float32),
    ]:
        want = sequential.batch_weight_sum(ws.double()).numpy()
        got = trie.batch_weight_sum(ws)
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_array_equal(got.double().numpy(), want)
    got = trie.batch_weight_sum(base.numpy().astype(np.float32))
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_array_equal(got, sequential.batch_weight_sum(base.numpy()))


@pytest.mark.skipif(not KERNEL_BUILT, reason="the compiled trie kernel was not built")
def test_compiled_results_are_dense_rows():
    trie = parallel_trie([b"a", b"ab", b"b"], "compiled")
    out = trie.batch_weight_sum(torch.ones(3, 3))
    assert out.is_contiguous() and out.device.type == "cpu"


@pytest.mark.skipif(not KERNEL_BUILT, reason="the compiled trie kernel was not built")
def test_kernel_rejects_plans_and_buffers_it_cannot_run():
    Plan = _compiled.KERNEL.Plan

    def i32(*xs):
        return np.array(xs, dtype=np.int32)

    # root 0 -> node 1 -> leaf 2: level 0 = [0, 1), level 1 = [1, 2)
    plan = Plan(1, i32(0, 1, 2), i32(1, 2), i32(0, 0, 0), i32(), i32())
    out = np.empty((2, 3), np.float32)
    plan.reduce("sum", np.array([[2.0], [3.0]], np.float32), out)
    np.testing.assert_array_equal(out, [[2, 2, 2], [3, 3, 3]])

    with pytest.raises(ValueError, match="plan"):  # node 1 reads itself
        Plan(1, i32(0, 1, 2), i32(1, 1), i32(0, 0, 0), i32(), i32())
    with pytest.raises(ValueError, match="plan"):  # reads past the last node
        Plan(1, i32(0, 1, 2), i32(1, 3), i32(0, 0, 0), i32(), i32())
    with pytest.raises(ValueError, match="plan"):  # an extra edge from the root's level
        Plan(1, i32(0, 1, 2), i32(1, 2), i32(0, 0, 1), i32(1), i32(0))
    with pytest.raises(ValueError, match="lengths"):
        Plan(1, i32(0, 1, 2), i32(1, 2), i32(0, 0), i32(), i32())
    with pytest.raises(TypeError, match="int32"):
        Plan(1, np.array([0, 1, 2]), i32(1, 2), i32(0, 0, 0), i32(), i32())

    with pytest.raises(ValueError, match="dtype"):
        plan.reduce("sum", np.ones((2, 1), np.float32), np.empty((2, 3), np.float64))
    with pytest.raises(ValueError, match="columns"):
        plan.reduce("sum", np.ones((2, 1), np.float32), np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match="columns"):
        plan.reduce("sum", np.ones((2, 1), np.int32), np.empty((2, 3), np.int32))
    with pytest.raises(ValueError, match="op"):
        plan.reduce("mean", np.ones((2, 1), np.float32), out)
    with pytest.raises(ValueError, match="contiguous"):
        plan.reduce("sum", np.ones((2, 1), np.float32), np.empty((2, 6), np.float32)[:, ::2])
    read_only = np.empty((2, 3), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        plan.reduce("sum", np.ones((2, 1), np.float32), read_only)
