"""Evaluation plans: which values to combine, in which order, to get every node's weight.

Both plans work on the *compressed* trie: an internal node with exactly one internal child
and no leaf (a prefix that is not a token and has a single continuation, ~45% of the
prefixes of a 131k vocabulary) always has the same value as that child, so it is not
computed, only copied from the nearest node below it that is not such a pass-through.
The remaining "real" nodes are stored in a value buffer indexed ``0 .. num_real - 1``.

* :class:`LevelPlan` orders the real nodes breadth-first over the compressed tree, so the
  real children of every compressed level form one contiguous block, sorted by parent.
  A node's value is then: its own leaves, combined with its children's block, one level at
  a time from the bottom. Least work; one step per compressed level (65 for tekken).
* :class:`FlatPlan` gathers, for every real node, the values it combines into one list and
  reduces all lists in one segmented reduction per stage. Stage 1 covers the nodes with at
  most ``fanin`` tokens below them, reading the token weights directly; every later stage
  covers the nodes with at most ``fanin`` times more, reading the values of earlier stages
  and the leaves of the nodes in between. A handful of large operations, whatever the
  depth: the plan for accelerators, where each operation costs a launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._layout import TrieLayout

__all__ = ["Compression", "FlatPlan", "LevelPlan", "compress", "flat_plan", "level_plan"]


@dataclass(frozen=True, eq=False)
class Compression:
    """Real nodes of a layout and how every internal node reads its value from them.

    Attributes:
        num_real: number of real nodes.
        real_nodes: ``[num_real]`` internal id of each real node, in value-buffer order.
        node_to_value: ``[num_internal]`` value-buffer index each internal node copies.
        compressed_parent: ``[num_real]`` value index of the nearest real proper ancestor
            (-1 for the top real node).
        leaf_value_parent: ``[V]`` value index of the node each leaf hangs from.
    """

    num_real: int
    real_nodes: np.ndarray
    node_to_value: np.ndarray
    compressed_parent: np.ndarray
    leaf_value_parent: np.ndarray


@dataclass(frozen=True, eq=False)
class LevelPlan:
    """Compressed levels, bottom-up: ``levels[j] = (start, stop, child_stop, parents)``.

    Level ``j`` holds value indices ``start .. stop``; its children are the values
    ``stop .. child_stop`` and ``parents[i]`` (relative to ``start``) is the parent of child
    ``stop + i``. ``levels`` runs from the deepest level with children to the top.
    """

    compression: Compression
    levels: list


@dataclass(frozen=True, eq=False)
class FlatPlan:
    """Staged segmented reductions (see the module docstring).

    Every stage reads a pool ``[leaf weights (V), values of earlier stages]`` and writes the
    values ``value_start .. value_start + len(lengths)`` of the value buffer (so the buffer
    is filled in stage order): ``gather`` indexes the pool, ``lengths`` splits it by node.
    """

    compression: Compression
    stages: list  # (value_start, gather [nnz], lengths [count])


def compress(layout: TrieLayout) -> Compression:
    """Finds the real nodes and the copy map of ``layout`` (see the module docstring)."""
    num_internal = layout.num_internal
    num_leaf_children = np.diff(layout.leaf_ptr)
    num_children = layout.child_hi - layout.child_lo
    passes = (num_children == 1) & (num_leaf_children == 0)
    starts = layout.level_starts
    nodes = np.arange(num_internal)

    # The real node each internal node copies: itself, or its only child's target.
    target = nodes.copy()
    for d in range(layout.max_depth, -1, -1):
        level = slice(int(starts[d]), int(starts[d + 1]))
        through = np.flatnonzero(passes[level]) + starts[d]
        target[through] = target[layout.child_lo[through]]

    # The nearest real ancestor-or-self of every internal node, top-down.
    nearest_real = np.where(passes, -1, nodes)
    real_parent = np.full(num_internal, -1, dtype=np.int64)
    for d in range(1, layout.max_depth + 1):
        level = slice(int(starts[d]), int(starts[d + 1]))
        above = nearest_real[layout.parent[level]]
        real_parent[level] = above
        nearest_real[level] = np.where(passes[level], above, nodes[level])

    real_nodes = _compressed_bfs(np.flatnonzero(~passes), real_parent, int(target[0]))
    value_of = np.full(num_internal, -1, dtype=np.int64)
    value_of[real_nodes] = np.arange(len(real_nodes))
    parents = real_parent[real_nodes]
    return Compression(
        num_real=len(real_nodes),
        real_nodes=real_nodes,
        node_to_value=value_of[target],
        compressed_parent=np.where(parents >= 0, value_of[np.maximum(parents, 0)], -1),
        leaf_value_parent=value_of[layout.leaf_parent],
    )


def _compressed_bfs(real: np.ndarray, real_parent: np.ndarray, top: int) -> np.ndarray:
    """Real nodes breadth-first over the compressed tree, children grouped by parent."""
    parents = real_parent[real]
    by_parent = np.argsort(parents, kind="stable")
    children = real[by_parent]
    sorted_parents = parents[by_parent]
    order = [np.array([top], dtype=np.int64)]
    frontier = order[0]
    while True:
        lo = np.searchsorted(sorted_parents, frontier, side="left")
        hi = np.searchsorted(sorted_parents, frontier, side="right")
        counts = hi - lo
        if not counts.any():
            break
        frontier = children[_concat_ranges(lo, counts)]
        order.append(frontier)
    return np.concatenate(order)


def level_plan(layout: TrieLayout, compression: Compression | None = None) -> LevelPlan:
    """Builds the :class:`LevelPlan` of ``layout``."""
    comp = compression or compress(layout)
    parent = comp.compressed_parent
    # value indices are breadth-first, so parents are non-decreasing along the buffer and a
    # level is a maximal run of nodes whose parents lie in the previous level
    levels = []
    start, stop = 0, 1
    while stop < comp.num_real:
        child_stop = int(np.searchsorted(parent, stop, side="left"))
        child_stop = max(child_stop, stop)
        levels.append((start, stop, child_stop, parent[stop:child_stop] - start))
        start, stop = stop, child_stop
    levels.reverse()
    return LevelPlan(compression=comp, levels=levels)


def flat_plan(
    layout: TrieLayout, fanin: int = 64, compression: Compression | None = None
) -> FlatPlan:
    """Builds the :class:`FlatPlan` of ``layout`` with at most ``fanin`` tokens per stage-1
    node and ``fanin`` times more per later stage."""
    comp = compression or compress(layout)
    num_items = layout.num_items
    real = comp.real_nodes
    size = (layout.range_hi - layout.range_lo)[real]
    stage_of = np.zeros(comp.num_real, dtype=np.int64)
    bound = fanin
    while (size > bound).any():
        stage_of[size > bound] += 1
        bound *= fanin
    # value buffer order = stage order; remember where every real node lands
    order = np.argsort(stage_of, kind="stable")
    pool_index = np.empty(comp.num_real, dtype=np.int64)
    pool_index[order] = num_items + np.arange(comp.num_real)

    child_values = _real_children(comp)
    stages = []
    for stage in range(int(stage_of.max()) + 1):
        members = order[stage_of[order] == stage]
        if len(members) == 0:
            continue
        value_start = int(np.searchsorted(stage_of[order], stage))
        if stage == 0:  # every token below, straight from the weights
            nodes = comp.real_nodes[members]
            lo, hi = layout.range_lo[nodes], layout.range_hi[nodes]
            lengths = hi - lo
            gather = layout.lex_positions[_concat_ranges(lo, lengths)]
        else:
            parts = [
                _frontier(int(v), stage, stage_of, child_values, comp, layout, pool_index)
                for v in members
            ]
            lengths = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
            gather = np.concatenate(parts)
        stages.append((value_start, gather, lengths))
    # Hand the caller the value order it must use: stage order.
    return FlatPlan(compression=_reorder(comp, order), stages=stages)


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + n) for s, n in zip(starts, lengths)])``, vectorised."""
    total = int(lengths.sum())
    offsets = np.repeat(starts - np.cumsum(lengths) + lengths, lengths)
    return offsets + np.arange(total)


def _real_children(comp: Compression) -> list:
    children: list = [[] for _ in range(comp.num_real)]
    for child, parent in enumerate(comp.compressed_parent.tolist()):
        if parent >= 0:
            children[parent].append(child)
    return children


def _frontier(v, stage, stage_of, child_values, comp, layout, pool_index) -> np.ndarray:
    """Pool indices whose combination is the value of real node ``v`` (stage >= 1)."""
    items: list = []
    todo = [v]
    while todo:
        u = todo.pop()
        node = comp.real_nodes[u]
        items.extend(layout.leaf_pos[layout.leaf_ptr[node] : layout.leaf_ptr[node + 1]].tolist())
        for c in child_values[u]:
            if stage_of[c] < stage:
                items.append(int(pool_index[c]))
            else:
                todo.append(c)
    return np.asarray(items, dtype=np.int64)


def _reorder(comp: Compression, order: np.ndarray) -> Compression:
    new_index = np.empty(comp.num_real, dtype=np.int64)
    new_index[order] = np.arange(comp.num_real)
    parents = comp.compressed_parent[order]
    return Compression(
        num_real=comp.num_real,
        real_nodes=comp.real_nodes[order],
        node_to_value=new_index[comp.node_to_value],
        compressed_parent=np.where(parents >= 0, new_index[np.maximum(parents, 0)], -1),
        leaf_value_parent=new_index[comp.leaf_value_parent],
    )
