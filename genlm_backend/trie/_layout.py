"""The shape of a token-character trie as flat numpy arrays, built without per-byte dicts.

Node numbering (every trie class shares it):
    * internal nodes (the root and every byte prefix of a token, plus one node per distinct
      end-of-sequence object) get ids ``0 .. num_internal - 1`` in breadth-first order: the
      root is ``0``, then the prefixes of length 1, of length 2, ...; within one depth the
      prefixes are in byte-lexicographic order and end-of-sequence nodes come after the
      byte nodes of depth 1. So every depth is one contiguous id range, and the internal
      children of any node are one contiguous id range of the next depth.
    * the leaf of the vocabulary item at position ``i`` is node ``num_internal + i``, so a
      weight vector maps onto the leaves by a plain copy.

Construction sorts the byte strings once, takes the longest common prefix of neighbours
(vectorised over a flat byte buffer), and derives every node from those: a token ``k`` in
sorted order creates the prefix nodes of depths ``lcp(k-1, k) + 1 .. len(k)``. The cost is a
Python sort plus numpy passes over the ~total number of bytes; no Python loop runs per byte.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..exceptions import InvalidRequestError, InvalidRequestTypeError

__all__ = ["TrieLayout", "build_layout"]


@dataclass(frozen=True, eq=False)
class TrieLayout:
    """Flat arrays describing one trie (see the module docstring for the numbering).

    Attributes:
        num_items: V, the length of the vocabulary (one leaf per position).
        num_internal: internal nodes, root included; leaves are ``num_internal + position``.
        level_starts: ``level_starts[d] .. level_starts[d+1]`` are the internal ids at depth d.
        parent: ``[num_internal]`` parent id of each internal node (-1 for the root).
        edge_byte: ``[num_internal]`` the byte on the edge into each internal node; -1 for
            the root, -2 for an end-of-sequence node.
        eos_nodes: end-of-sequence object -> its internal node id.
        leaf_parent: ``[V]`` the internal node each position's leaf hangs from.
        child_lo, child_hi: ``[num_internal]`` the id range of each node's internal children.
        leaf_ptr, leaf_pos: CSR of the leaf children: positions ``leaf_pos[leaf_ptr[n] :
            leaf_ptr[n+1]]`` hang directly from internal node ``n``, in increasing order.
        lex_positions: ``[V]`` positions ordered by their byte strings (end-of-sequence
            items last); the items below internal node ``n`` are
            ``lex_positions[range_lo[n] : range_hi[n]]``.
        range_lo, range_hi: ``[num_internal]`` see ``lex_positions``.
        words: ``[V]`` each item as plain ``bytes``, or the end-of-sequence object itself.
        token_ids: ``[V]`` the id of each item: a Token's own ``token_id``, else its position.
    """

    num_items: int
    num_internal: int
    level_starts: np.ndarray
    parent: np.ndarray
    edge_byte: np.ndarray
    eos_nodes: dict
    leaf_parent: np.ndarray
    child_lo: np.ndarray
    child_hi: np.ndarray
    leaf_ptr: np.ndarray
    leaf_pos: np.ndarray
    lex_positions: np.ndarray
    range_lo: np.ndarray
    range_hi: np.ndarray
    words: list
    token_ids: list

    @property
    def num_nodes(self) -> int:
        return self.num_internal + self.num_items

    @property
    def max_depth(self) -> int:
        """Depth of the deepest internal node (leaves sit one below their parent)."""
        return len(self.level_starts) - 2


def _normalise(decode: Sequence[Any]) -> tuple[list, list, list[int], list[int]]:
    """Splits the vocabulary into plain byte strings and end-of-sequence objects."""
    if isinstance(decode, (str, bytes, bytearray)) or not hasattr(decode, "__len__"):
        raise InvalidRequestTypeError(
            f"decode must be a sequence of byte strings, got {type(decode).__name__}"
        )
    if len(decode) == 0:
        raise InvalidRequestError("decode is empty: a trie needs at least one token")
    words = list(decode)
    num_items = len(words)
    token_ids = list(range(num_items))
    eos_positions: list[int] = []
    if not all(type(item) is bytes for item in words):
        for i, item in enumerate(words):
            if type(item) is bytes:
                continue
            if isinstance(item, (bytes, bytearray, memoryview)):
                words[i] = bytes(item)
                token_id = getattr(item, "token_id", None)
                if isinstance(token_id, int):
                    token_ids[i] = token_id
            else:
                _check_eos(item, i)
                eos_positions.append(i)
    if eos_positions:
        is_eos = set(eos_positions)
        byte_positions = [i for i in range(num_items) if i not in is_eos]
    else:
        byte_positions = list(range(num_items))
    return words, token_ids, byte_positions, eos_positions


def _check_eos(item: Any, position: int) -> None:
    if isinstance(item, str):
        raise InvalidRequestTypeError(
            f"decode[{position}] is the str {item!r}; tries are over bytes: pass "
            f"{item.encode()!r} (or use decode_vocab)"
        )
    try:
        symbols = list(item) if isinstance(item, Hashable) else None
    except TypeError:
        symbols = None
    if symbols is None or len(symbols) != 1 or symbols[0] is not item:
        raise InvalidRequestTypeError(
            f"decode[{position}] = {item!r} is neither bytes-like nor a hashable "
            "end-of-sequence object that iterates to itself"
        )


def _common_prefix_lengths(flat: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """``lcp[k]`` = common prefix length of sorted strings k-1 and k (``lcp[0] = 0``)."""
    num = len(lens)
    lcp = np.zeros(num, dtype=np.int64)
    if num < 2:
        return lcp
    shared = np.minimum(lens[:-1], lens[1:])
    pairs = np.flatnonzero(shared)
    if len(pairs) == 0:
        return lcp
    counts = shared[pairs]
    seg_start = np.zeros(len(pairs), dtype=np.int64)
    np.cumsum(counts[:-1], out=seg_start[1:])
    offset = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(seg_start, counts)
    left = flat[np.repeat(starts[pairs], counts) + offset]
    right = flat[np.repeat(starts[pairs + 1], counts) + offset]
    # first mismatching offset of each pair, or the shared length when there is none
    first = np.where(left != right, offset, np.repeat(counts, counts))
    lcp[pairs + 1] = np.minimum.reduceat(first, seg_start)
    return lcp


def build_layout(decode: Sequence[Any]) -> TrieLayout:
    """Builds the :class:`TrieLayout` of ``decode`` (see the module docstring).

    Raises:
        InvalidRequestError: ``decode`` is empty.
        InvalidRequestTypeError: an item is neither bytes-like nor an end-of-sequence object.
    """
    words, token_ids, byte_positions, eos_positions = _normalise(decode)
    num_items = len(words)

    # ---- byte strings in lexicographic order, and their neighbours' common prefixes ----
    byte_positions.sort(key=words.__getitem__)
    sorted_words = [words[i] for i in byte_positions]
    num_sorted = len(sorted_words)
    lens = np.fromiter(map(len, sorted_words), dtype=np.int64, count=num_sorted)
    starts = np.zeros(num_sorted, dtype=np.int64)
    if num_sorted:
        np.cumsum(lens[:-1], out=starts[1:])
    flat = np.frombuffer(b"".join(sorted_words), dtype=np.uint8)
    lcp = _common_prefix_lengths(flat, starts, lens)

    # ---- prefix nodes in depth-first creation order ----
    created = lens - lcp  # prefix nodes first seen at each sorted string
    num_prefix = int(created.sum())
    creator = np.repeat(np.arange(num_sorted), created)
    first_new = np.zeros(num_sorted, dtype=np.int64)
    if num_sorted:
        np.cumsum(created[:-1], out=first_new[1:])
    depth = np.arange(num_prefix, dtype=np.int64) - np.repeat(first_new - lcp - 1, created)
    edge_byte = flat[starts[creator] + depth - 1].astype(np.int16)

    # end-of-sequence nodes: depth 1, after every byte node of depth 1
    eos_nodes: dict = {}
    eos_order: list = []
    for i in eos_positions:
        if words[i] not in eos_nodes:
            eos_nodes[words[i]] = len(eos_order)
            eos_order.append(words[i])
    num_eos = len(eos_order)
    depth = np.concatenate([depth, np.ones(num_eos, dtype=np.int64)])
    edge_byte = np.concatenate([edge_byte, np.full(num_eos, -2, dtype=np.int16)])

    # ---- breadth-first ids: a stable sort by depth keeps each depth lexicographic ----
    bfs = np.argsort(
        depth.astype(np.uint16 if len(depth) and depth.max() < 2**16 else np.int64), kind="stable"
    )  # creation index of the node with id 1 + j
    depth_bfs = depth[bfs]
    num_internal = 1 + len(bfs)
    max_depth = int(depth_bfs[-1]) if len(bfs) else 0
    level_starts = np.concatenate(
        [[0], 1 + np.searchsorted(depth_bfs, np.arange(1, max_depth + 2))]
    ).astype(np.int64)

    # The parent of a node is the last node one level up created before it. ``keys`` are
    # the non-root nodes in id order (id = index + 1); a depth-1 node finds no key below its
    # own, so its parent comes out as 0, the root.
    span = num_prefix + num_eos + 1
    keys = depth_bfs * span + bfs  # sorted ascending
    parent = np.empty(num_internal, dtype=np.int64)
    parent[0] = -1
    parent[1:] = np.searchsorted(keys, (depth_bfs - 1) * span + bfs, side="left")

    # ---- leaves ----
    leaf_parent = np.zeros(num_items, dtype=np.int64)
    if num_sorted:
        last_created = first_new + created - 1  # last creation index up to each string
        terminal_key = lens * span + last_created
        terminal = np.searchsorted(keys, terminal_key, side="right")  # id of the terminal
        leaf_parent[np.asarray(byte_positions, dtype=np.int64)] = np.where(lens > 0, terminal, 0)
    first_eos_id = int(level_starts[2]) - num_eos if num_eos else num_internal
    for i in eos_positions:
        leaf_parent[i] = first_eos_id + eos_nodes[words[i]]
    eos_nodes = {obj: first_eos_id + j for obj, j in eos_nodes.items()}

    # ---- children and item ranges ----
    num_children = np.bincount(parent[1:], minlength=num_internal)
    child_lo = np.ones(num_internal, dtype=np.int64)
    np.cumsum(num_children[:-1], out=child_lo[1:])
    child_lo[1:] += 1
    child_hi = child_lo + num_children
    leaf_pos = np.argsort(leaf_parent, kind="stable")
    num_leaves_below = np.bincount(leaf_parent, minlength=num_internal)
    leaf_ptr = np.zeros(num_internal + 1, dtype=np.int64)
    np.cumsum(num_leaves_below, out=leaf_ptr[1:])

    # In lexicographic order a node's tokens are one run: its own leaves first, then its
    # children's runs in child order. The run starts at the token that created the node.
    eos_sorted = sorted(eos_positions, key=lambda i: (leaf_parent[i], i))
    lex_positions = np.asarray(byte_positions + eos_sorted, dtype=np.int64)
    range_lo = np.empty(num_internal, dtype=np.int64)
    range_lo[0] = 0
    range_lo[1:] = np.concatenate([creator, np.zeros(num_eos, dtype=np.int64)])[bfs]
    if num_eos:
        eos_ids = np.arange(first_eos_id, first_eos_id + num_eos)
        range_lo[eos_ids] = (
            num_sorted + np.cumsum(num_leaves_below[eos_ids]) - num_leaves_below[eos_ids]
        )
    range_hi = range_lo + num_leaves_below
    for d in range(max_depth - 1, -1, -1):
        level = slice(int(level_starts[d]), int(level_starts[d + 1]))
        has_children = num_children[level] > 0
        last_child = child_hi[level][has_children] - 1
        range_hi[level][has_children] = range_hi[last_child]

    return TrieLayout(
        num_items=num_items,
        num_internal=num_internal,
        level_starts=level_starts,
        parent=parent,
        edge_byte=np.concatenate([[-1], edge_byte[bfs]]).astype(np.int16),
        eos_nodes=eos_nodes,
        leaf_parent=leaf_parent,
        child_lo=child_lo,
        child_hi=child_hi,
        leaf_ptr=leaf_ptr,
        leaf_pos=leaf_pos,
        lex_positions=lex_positions,
        range_lo=range_lo,
        range_hi=range_hi,
        words=words,
        token_ids=token_ids,
    )
