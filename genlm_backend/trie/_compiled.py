"""The optional compiled CPU kernel of :class:`ParallelTokenCharacterTrie` (``_kernel.c``).

``pip install`` builds ``genlm_backend.trie._kernel`` where a C compiler is available (see
``setup.py``); without one :data:`KERNEL` is ``None`` and the tries keep their torch/numpy
path. ``GENLM_REQUIRE_TRIE_KERNEL=1`` makes the test suite fail when the build was skipped.

The plan: every internal node has one or more *sources* (the leaves hanging from it and its
internal children). The kernel fills a row's leaves with the weights, then goes level by
level from the deepest: each node of the level copies its first source, then the level's
*extra* edges (every other source) are added (or maxed) into their nodes. No loop has a
data-dependent branch, which is what makes it fast: a per-node loop over a variable number
of sources mispredicts about once per node.

Threads: rows are shared out, one at a time, between ``torch.get_num_threads()`` threads
(at most one per row), so ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` bound the
kernel as they bound torch. The kernel starts its own short-lived POSIX threads rather
than using OpenMP, so no second OpenMP runtime is loaded beside torch's; starting them
costs tens of microseconds a call. Page faults and the computation then run on every
core given (``benchmarks/README.md`` has a batch timed with one thread and two).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._layout import TrieLayout
from ._memory import empty_cpu

try:  # (the module itself: ``from . import`` would name the package, which imports this one)
    KERNEL = importlib.import_module("._kernel", __package__)
except ImportError:  # built without a compiler, or not built: the torch path runs instead
    KERNEL = None

__all__ = ["KERNEL", "CompiledPlan", "compiled_plan"]


@dataclass(frozen=True, eq=False)
class CompiledPlan:
    """A layout's plan in the kernel's form."""

    plan: Any  # _kernel.Plan
    num_nodes: int

    def run(self, op: str, weights: torch.Tensor) -> torch.Tensor:
        """``[B, num_nodes]`` sums (``op="sum"``) or maxima (``"max"``) of CPU float32 or
        float64 ``weights [B, V]``, in their dtype, on ``torch.get_num_threads()``
        threads."""
        weights = weights.resolve_conj().resolve_neg().contiguous()
        out = empty_cpu((weights.shape[0], self.num_nodes), weights.dtype)
        self.plan.reduce(op, weights.numpy(), out.numpy(), torch.get_num_threads())
        return out


def compiled_plan(layout: TrieLayout) -> CompiledPlan:
    """Builds the kernel's plan of ``layout`` (the kernel must have been imported)."""
    num_internal = layout.num_internal
    nodes = np.arange(num_internal)
    # every edge (internal node, source): the leaves hanging from it, as node ids, and its
    # internal children; sorted by node, so its first source is its first child if any
    leaf_dst = np.repeat(nodes, np.diff(layout.leaf_ptr))
    leaf_src = num_internal + layout.leaf_pos
    child_src = np.arange(1, num_internal)
    child_dst = layout.parent[1:]
    dst = np.concatenate([leaf_dst, child_dst])
    src = np.concatenate([leaf_src, child_src])
    order = np.lexsort((src, dst))
    dst, src = dst[order], src[order]
    first = np.searchsorted(dst, nodes)
    if not np.array_equal(dst[np.minimum(first, len(dst) - 1)], nodes):
        raise RuntimeError("an internal node of the trie has nothing below it")  # a bug
    # The extra edges of a level in rounds: every node's second source, then every third
    # source, ... so consecutive edges update different nodes instead of each waiting for
    # the previous one's store to the same node.
    rank = np.arange(len(dst)) - first[dst]
    level = np.searchsorted(layout.level_starts, dst, side="right") - 1
    extra = np.flatnonzero(rank > 0)
    extra = extra[np.lexsort((dst[extra], rank[extra], level[extra]))]
    extra_dst, extra_src = dst[extra], src[extra]
    level_start = layout.level_starts  # depth d: internal ids level_start[d] .. [d + 1]
    extra_start = np.searchsorted(level[extra], np.arange(len(level_start)))
    plan = KERNEL.Plan(
        layout.num_items,
        level_start.astype(np.int32),
        src[first].astype(np.int32),
        extra_start.astype(np.int32),
        extra_dst.astype(np.int32),
        extra_src.astype(np.int32),
    )
    return CompiledPlan(plan=plan, num_nodes=layout.num_nodes)
