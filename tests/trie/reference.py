"""An independent brute-force reference for the tries: walk ``children`` from ``root`` to
learn which prefix every node id stands for, then sum / max over the tokens directly."""

from __future__ import annotations

import math

import numpy as np


def symbols(item) -> tuple:
    """The edge labels spelling ``item``: its bytes as ints, or an EOS object alone."""
    if isinstance(item, (bytes, bytearray)):
        return tuple(bytes(item))
    return (item,)


def node_prefixes(trie) -> tuple[dict, dict]:
    """``(prefix_of_internal_node, position_of_leaf)`` found by walking the public edges.

    Asserts that every node id is reached exactly once, that leaf edges are labelled
    ``(None, position)`` and lead to nodes without children.
    """
    prefixes: dict = {}
    leaves: dict = {}
    stack = [(trie.root, ())]
    while stack:
        node, prefix = stack.pop()
        assert node not in prefixes and node not in leaves, f"node {node} reached twice"
        prefixes[node] = prefix
        for label, child in trie.children[node].items():
            if isinstance(label, tuple):
                assert label[0] is None and len(label) == 2, label
                assert trie.children[child] == {}, "a leaf has children"
                assert child not in leaves, f"leaf {child} reached twice"
                leaves[child] = label[1]
            else:
                stack.append((child, prefix + (label,)))
    assert len(prefixes) + len(leaves) == trie.num_nodes
    return prefixes, leaves


def reference(trie, decode, weights: np.ndarray, op: str) -> np.ndarray:
    """``[num_nodes]`` float64 sums (``math.fsum``) or maxima, straight from the tokens."""
    prefixes, leaves = node_prefixes(trie)
    spelled = [symbols(item) for item in decode]
    out = np.full(trie.num_nodes, np.nan)
    for leaf, position in leaves.items():
        out[leaf] = weights[position]
    for node, prefix in prefixes.items():
        below = [weights[i] for i, s in enumerate(spelled) if s[: len(prefix)] == prefix]
        out[node] = math.fsum(below) if op == "sum" else max(below)
    return out
