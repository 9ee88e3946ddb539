"""What the compiled trie kernel (``_kernel.c``) leaves behind on every path: counted.

Each call of ``Plan(...)`` and ``Plan.reduce(...)``, taken and refused, must leave every
argument with the references it had (a buffer taken and not released holds one on its
array), and must not keep memory: a plan that failed is freed with its copies of the
arrays. References are read with ``sys.getrefcount``; memory with ``tracemalloc``, which
sees the kernel's ``PyMem_Malloc`` copies and the plan objects, over many repeats of a path
(a leak of a plan grows with the repeats; allocator caches do not).

``scripts/check_c.sh`` runs this file and ``test_trie_kernel.py`` against a build of the
kernel with AddressSanitizer.
"""

from __future__ import annotations

import sys
import tracemalloc

import numpy as np
import pytest

from genlm_backend.trie import _compiled

pytestmark = pytest.mark.skipif(
    _compiled.KERNEL is None, reason="the compiled trie kernel was not built"
)

REPEATS = 400
# What repeats may keep at most whatever the path: allocator caches and the interpreter's own
# freelists, a few KiB; a plan that leaked (an object and five arrays) would keep over 40 KiB.
MAX_KEPT_BYTES = 8 * 1024


def i32(*xs):
    return np.array(xs, dtype=np.int32)


def good_plan_args():
    # root 0 with children 1 and 2, leaves 3 (under 1) and 4 (under 2) and 5 (under the root)
    return [3, i32(0, 1, 3), i32(1, 3, 4), i32(0, 2, 2), i32(0, 0), i32(2, 5)]


def plan_cases():
    bad_plan = good_plan_args()
    bad_plan[2] = i32(0, 3, 4)  # the root reads itself
    short = good_plan_args()
    short[3] = i32(0, 2)
    wide = good_plan_args()
    wide[1] = np.array([0, 1, 3])  # int64
    two_d = good_plan_args()
    two_d[4] = np.zeros((2, 1), np.int32)
    not_buffer = good_plan_args()
    not_buffer[5] = [2, 5]
    last_bad = good_plan_args()
    last_bad[5] = i32(2, 6)  # past the last node: found after every array was copied
    no_items = good_plan_args()
    no_items[0] = 0
    return [
        ("plan", good_plan_args(), None),
        ("a node reads itself", bad_plan, ValueError),
        ("lengths disagree", short, ValueError),
        ("an int64 array", wide, TypeError),
        ("a 2-D array", two_d, TypeError),
        ("a list", not_buffer, TypeError),
        ("a source past the last node", last_bad, ValueError),
        ("no leaves", no_items, ValueError),
    ]


def kept_bytes(call, repeats=REPEATS):
    """Bytes still allocated after ``repeats`` more calls than a warm-up of the same calls."""
    for _ in range(20):
        call()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(repeats):
            call()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def run_case(fn, args, error):
    def call():
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - checked, then dropped with its traceback
            assert error is not None and type(exc) is error, repr(exc)
        else:
            assert error is None

    # not shared ints, strings, None
    watched = [a for a in args if isinstance(a, (np.ndarray, list))]
    refs = [sys.getrefcount(a) for a in watched]
    call()
    assert [sys.getrefcount(a) for a in watched] == refs
    kept = kept_bytes(call)
    assert kept < MAX_KEPT_BYTES, f"{kept} bytes kept after {REPEATS} calls"
    assert [sys.getrefcount(a) for a in watched] == refs


@pytest.mark.parametrize(
    "args, error", [c[1:] for c in plan_cases()], ids=[c[0] for c in plan_cases()]
)
def test_making_a_plan_keeps_nothing_on_any_path(args, error):
    run_case(_compiled.KERNEL.Plan, args, error)


def reduce_cases():
    plan = _compiled.KERNEL.Plan(*good_plan_args())
    w32, w64 = np.ones((3, 3), np.float32), np.ones((3, 3), np.float64)
    out32, out64 = np.empty((3, 6), np.float32), np.empty((3, 6), np.float64)
    read_only = np.empty((3, 6), np.float32)
    read_only.flags.writeable = False
    return plan, [
        ("sum", ("sum", w32, out32), None),
        ("max", ("max", w64, out64), None),
        ("sum on two threads", ("sum", w64, out64, 2), None),
        ("no rows", ("sum", w32[:0], out32[:0]), None),
        ("another op", ("mean", w32, out32), ValueError),
        ("dtypes disagree", ("sum", w32, out64), ValueError),
        ("rows disagree", ("sum", w32, out32[:2]), ValueError),
        ("columns of out", ("sum", w32, np.empty((3, 5), np.float32)), ValueError),
        ("columns of weights", ("sum", np.ones((3, 2), np.float32), out32), ValueError),
        ("int weights", ("sum", np.ones((3, 3), np.int32), out32), ValueError),
        ("strided out", ("sum", w32, np.empty((3, 12), np.float32)[:, ::2]), ValueError),
        ("read-only out", ("sum", w32, read_only), ValueError),
        ("weights not a buffer", ("sum", [[1.0] * 3] * 3, out32), TypeError),
        ("out not a buffer", ("sum", w32, None), TypeError),
    ]


@pytest.mark.parametrize(
    "index", range(len(reduce_cases()[1])), ids=[c[0] for c in reduce_cases()[1]]
)
def test_reducing_keeps_nothing_on_any_path(index):
    plan, cases = reduce_cases()
    _, args, error = cases[index]
    plan_refs = sys.getrefcount(plan)
    run_case(plan.reduce, args, error)
    assert sys.getrefcount(plan) == plan_refs


def test_a_compiled_trie_keeps_nothing_per_call():
    """The kernel through ``CompiledPlan.run``, as the tries call it."""
    import torch

    from genlm_backend.trie import ParallelTokenCharacterTrie

    trie = ParallelTokenCharacterTrie([b"a", b"ab", b"b", b"abc", b"c"])
    assert trie._use_compiled
    weights = torch.rand(4, 5, dtype=torch.float64)
    refs = sys.getrefcount(weights)
    for op in (trie.batch_weight_sum, trie.batch_weight_max):
        kept = kept_bytes(lambda op=op: op(weights), repeats=200)
        assert kept < MAX_KEPT_BYTES, f"{kept} bytes kept after 200 calls"
    assert sys.getrefcount(weights) == refs


def test_reduce_refuses_an_out_that_overlaps_the_weights():
    """The kernel copies each row's weights into ``out`` and threads write other rows: an
    ``out`` that shares memory with ``weights`` would be read after it was written (and
    ``memcpy`` between overlapping ranges is undefined)."""
    plan = _compiled.KERNEL.Plan(*good_plan_args())
    block = np.zeros(4 * 6, np.float64)
    out = block.reshape(4, 6)
    for weights in (out[:1, :3], out[:1, 2:5], block[4:16].reshape(4, 3)):
        with pytest.raises(ValueError, match="overlap"):
            plan.reduce("sum", weights, out[: len(weights)])
    # Adjacent is not overlapping: the weights just past the end of out.
    plan.reduce("sum", block[18:21].reshape(1, 3), block[:6].reshape(1, 6))
