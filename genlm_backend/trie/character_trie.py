"""``TokenCharacterTrie``: the trie of a byte vocabulary and its sequential (numpy) weights."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ._children import Children
from ._layout import TrieLayout, build_layout
from ._memory import empty_cpu
from ._plan import LevelPlan, level_plan
from ._weights import WeightsInfo, check_weights, to_numpy, wrap_result

__all__ = ["TokenCharacterTrie"]


class TokenCharacterTrie:
    """The trie of a byte vocabulary, with the total and the maximum weight below each node.

    Nodes are the byte prefixes of the tokens (the root is the empty prefix) plus one leaf
    per vocabulary position, so tokens with identical bytes keep separate leaves.

    ``decode`` is a sequence of byte strings (``bytes``, ``Token`` or any bytes-like object)
    in the caller's order: position ``i`` is the index of the token's weight. Besides byte
    strings it may hold hashable end-of-sequence objects that iterate to themselves (as
    constrained samplers append): such an object gets one edge from the root, labelled by
    the object itself, and a leaf below it.

    Attributes:
        decode: the vocabulary as given.
        root: the root's node id (always 0).
        children: ``children[node]`` is a dict from edge label to child id: an ``int`` byte,
            an end-of-sequence object, or ``(None, position)`` for the edge to the leaf of
            the token at ``position``. Built lazily per node (see :class:`Children`).
        word2leaf: ``(byte_string, token_id) -> leaf`` for a ``Token`` (``byte_string`` is
            plain ``bytes``, ``token_id`` the Token's own id), ``bytes -> leaf`` for plain
            bytes, and ``obj -> leaf`` for an end-of-sequence object (as genlm-backend
            0.3.1 keys them). If a key occurs more than once
            the first position wins; every position still has its own leaf.
        num_nodes: internal nodes plus leaves; results of the weight methods have this
            length. Internal nodes are numbered breadth-first; the leaf of the token at
            position ``i`` is ``num_nodes - len(decode) + i``.

    Weights (``weight_sum`` and friends) accept a ``torch.Tensor``, a numpy array, a list or
    a tuple. A tensor gives a tensor on the same device with the input's dtype (float32
    for dtypes other than float32/float64); anything else gives a float64 numpy array.
    This class computes on the CPU with numpy (a CUDA tensor is copied to the CPU and its
    result copied back), summing in float64 (maxima are exact in any dtype); it is the
    reference that :class:`ParallelTokenCharacterTrie` is tested against. Batched methods
    run row by row.

    Raises:
        InvalidRequestError: ``decode`` is empty.
        InvalidRequestTypeError: an item is neither bytes-like nor an end-of-sequence object.
    """

    def __init__(self, decode: Sequence[Any]):
        self.decode = decode
        self._layout: TrieLayout = build_layout(decode)
        self._plan: LevelPlan = level_plan(self._layout)
        layout = self._layout
        self.root = 0
        self.num_nodes = layout.num_nodes
        self.children = Children(layout)
        self.word2leaf = _word2leaf(decode, layout)
        self._numpy_kernels = _NumpyKernels(layout, self._plan)

    # ---- structure ----------------------------------------------------------------------

    @property
    def num_leaves(self) -> int:
        """One leaf per vocabulary position."""
        return self._layout.num_items

    @property
    def first_leaf(self) -> int:
        """Node id of the leaf of position 0; position ``i`` has leaf ``first_leaf + i``."""
        return self._layout.num_internal

    @cached_property
    def leaf2word(self) -> dict:
        """``leaf -> word2leaf key`` of every position (the inverse of ``word2leaf`` plus the
        leaves of repeated keys)."""
        return dict(zip(self.token_id_to_leaf.tolist(), _word_keys(self.decode, self._layout)))

    @cached_property
    def leaf2token_id(self) -> dict:
        """``leaf -> token id`` (a ``Token``'s own id, else its position)."""
        return {self.first_leaf + i: t for i, t in enumerate(self._layout.token_ids)}

    @property
    def token_id_to_leaf(self) -> np.ndarray:
        """``[V]`` leaf node id of every position."""
        return np.arange(self.first_leaf, self.num_nodes)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.num_leaves} tokens, {self.num_nodes} nodes, "
            f"depth {self._layout.max_depth + 1})"
        )

    # ---- weights ------------------------------------------------------------------------

    def weight_sum(self, ws: Any) -> Any:
        """The total weight of the tokens below every node.

        Args:
            ws: ``[V]`` weights (e.g. probabilities), indexed by vocabulary position.

        Returns:
            ``[num_nodes]`` totals indexed by node id (see the class docstring for the type).

        Raises:
            InvalidRequestError: wrong shape or length, or a NaN.
            InvalidRequestTypeError: not an array of real numbers.
        """
        return self._run(self._numpy_kernels.sum, ws, batched=False)

    def weight_max(self, ws: Any) -> Any:
        """The largest weight of the tokens below every node; correct for negative inputs
        such as log-weights, including ``-inf``. Same arguments and results as
        :meth:`weight_sum`."""
        return self._run(self._numpy_kernels.max, ws, batched=False)

    def batch_weight_sum(self, ws: Any) -> Any:
        """:meth:`weight_sum` of every row of ``[B, V]`` weights; returns ``[B, num_nodes]``."""
        return self._run(self._numpy_kernels.sum, ws, batched=True)

    def batch_weight_max(self, ws: Any) -> Any:
        """:meth:`weight_max` of every row of ``[B, V]`` weights; returns ``[B, num_nodes]``."""
        return self._run(self._numpy_kernels.max, ws, batched=True)

    def _run(self, kernel, ws: Any, *, batched: bool) -> Any:
        arr, info = check_weights(ws, self.num_leaves, batched=batched)
        return self._run_numpy(kernel, arr, info, batched=batched)

    def _run_numpy(self, kernel, arr: Any, info: WeightsInfo, *, batched: bool) -> Any:
        values = to_numpy(arr)
        dtype = np.float32 if info.is_tensor and info.dtype == torch.float32 else np.float64
        if not batched:
            return wrap_result(kernel(values, dtype), info)
        out = empty_cpu((values.shape[0], self.num_nodes), dtype, like="numpy")
        for row, out_row in zip(values, out):
            kernel(row, dtype, out=out_row)
        return wrap_result(out, info)


def _word_keys(decode: Sequence[Any], layout: TrieLayout) -> list:
    """The ``word2leaf`` key of every position, as genlm-backend 0.3.1 keys them: a byte
    token's ``(byte_string, token_id)`` (a ``Token``, an object with an int ``token_id``),
    plain bytes themselves, an end-of-sequence object itself."""
    keys = []
    for item, word in zip(decode, layout.words):
        if type(item) is bytes:
            keys.append(item)
        elif isinstance(item, (bytes, bytearray, memoryview)):
            token_id = getattr(item, "token_id", None)
            keys.append((word, token_id) if isinstance(token_id, int) else word)
        else:
            keys.append(item)
    return keys


def _word2leaf(decode: Sequence[Any], layout: TrieLayout) -> dict:
    keys = _word_keys(decode, layout)
    leaves = range(layout.num_internal, layout.num_nodes)
    word2leaf = dict(zip(keys, leaves))
    if len(word2leaf) < len(keys):  # a repeated key: the first position wins
        word2leaf = {}
        for key, leaf in zip(keys, leaves):
            word2leaf.setdefault(key, leaf)
    return word2leaf


class _NumpyKernels:
    """Sum and max over the compressed levels of a :class:`LevelPlan`, one vector at a time.

    Sums use ``bincount`` (empty segments are free); maxima use ``maximum.reduceat`` over
    the nodes that do have children. Both end with one gather from the real nodes' values
    to every internal node and a copy of the weights into the leaves.
    """

    def __init__(self, layout: TrieLayout, plan: LevelPlan):
        comp = plan.compression
        self.num_internal = layout.num_internal
        self.num_nodes = layout.num_nodes
        self.num_real = comp.num_real
        self.node_to_value = comp.node_to_value
        self.leaf_parent = comp.leaf_value_parent
        self.levels = plan.levels
        # maxima: own leaves sorted by parent, and per level the parents with children
        self.leaf_order = np.argsort(self.leaf_parent, kind="stable")
        sorted_parents = self.leaf_parent[self.leaf_order]
        own_nodes, own_starts, own_counts = np.unique(
            sorted_parents, return_index=True, return_counts=True
        )
        single = own_counts == 1  # most nodes hold one leaf: a plain copy, no reduction
        self.single_nodes = own_nodes[single]
        self.single_leaves = self.leaf_order[own_starts[single]]
        self.multi_nodes = own_nodes[~single]
        multi_leaves = np.isin(sorted_parents, self.multi_nodes)
        self.multi_order = self.leaf_order[multi_leaves]
        self.multi_starts = np.searchsorted(sorted_parents[multi_leaves], self.multi_nodes)
        self.max_levels = []
        for start, stop, child_stop, parents in self.levels:
            nodes, first_child = np.unique(parents, return_index=True)
            self.max_levels.append((start + nodes, stop, child_stop, first_child))

    def sum(self, w: np.ndarray, dtype: type, out: np.ndarray | None = None) -> np.ndarray:
        val = np.bincount(self.leaf_parent, weights=w, minlength=self.num_real)
        for start, stop, child_stop, parents in self.levels:
            val[start:stop] += np.bincount(
                parents, weights=val[stop:child_stop], minlength=stop - start
            )
        return self._assemble(val, w, dtype, out)

    def max(self, w: np.ndarray, dtype: type, out: np.ndarray | None = None) -> np.ndarray:
        val = np.full(self.num_real, -np.inf)
        val[self.single_nodes] = w[self.single_leaves]
        if len(self.multi_nodes):
            val[self.multi_nodes] = np.maximum.reduceat(w[self.multi_order], self.multi_starts)
        for targets, stop, child_stop, first_child in self.max_levels:
            below = np.maximum.reduceat(val[stop:child_stop], first_child)
            val[targets] = np.maximum(val[targets], below)
        return self._assemble(val, w, dtype, out)

    def _assemble(self, val, w, dtype, out) -> np.ndarray:
        if out is None:
            out = np.empty(self.num_nodes, dtype=dtype)
        np.take(val.astype(dtype, copy=False), self.node_to_value, out=out[: self.num_internal])
        out[self.num_internal :] = w
        return out
