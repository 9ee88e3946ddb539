"""``trie.children``: a list-like view whose items are the edge dicts, built on first use."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from ._layout import TrieLayout

__all__ = ["Children"]


class Children(Sequence):
    """``children[node]`` is a dict from edge label to child node id.

    Edge labels: an ``int`` byte value, the end-of-sequence object itself, or, for the edge
    to a leaf, the tuple ``(None, position)`` where ``position`` is the token's index in the
    vocabulary (its weight index). Leaves have no children (an empty dict). Items are in
    the order leaf edges, byte edges by increasing byte, end-of-sequence edges.

    The dicts are built from the flat layout on first access and cached, so building a
    trie does not pay for the ~400k dicts of a 131k vocabulary up front; it behaves like
    the list of dicts the reference implementation stored (indexing, ``len``, iteration).
    """

    def __init__(self, layout: TrieLayout):
        self._layout = layout
        self._eos_of_node = {node: obj for obj, node in layout.eos_nodes.items()}
        self._cache: dict[int, dict] = {}

    def __len__(self) -> int:
        return self._layout.num_nodes

    def __getitem__(self, node: Any) -> Any:
        if isinstance(node, slice):
            return [self[i] for i in range(*node.indices(len(self)))]
        node = operator.index(node)
        size = len(self)
        if node < 0:
            node += size
        if not 0 <= node < size:
            raise IndexError(f"node {node} is outside the trie's {size} nodes")
        edges = self._cache.get(node)
        if edges is None:
            edges = self._cache[node] = self._edges(node)
        return edges

    def _edges(self, node: int) -> dict:
        layout = self._layout
        if node >= layout.num_internal:
            return {}
        first_leaf = layout.num_internal
        positions = layout.leaf_pos[layout.leaf_ptr[node] : layout.leaf_ptr[node + 1]]
        edges: dict = {(None, int(p)): first_leaf + int(p) for p in positions}
        lo, hi = int(layout.child_lo[node]), int(layout.child_hi[node])
        for child, label in zip(range(lo, hi), layout.edge_byte[lo:hi].tolist()):
            edges[label if label >= 0 else self._eos_of_node[child]] = child
        return edges
