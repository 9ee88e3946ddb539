"""A trie of token prefixes that remembers the key/value states computed for them, in bounded
memory.

Blocks
    Every forward pass of the Hugging Face backend leaves one :class:`KVBlock`: per decoder
    layer a key and a value tensor ``[rows, kv_heads, length, head_dim]``. Row ``r`` holds
    the states of one sequence after ``offsets[r]`` padding positions, so the states of its
    first ``d`` tokens are ``keys[r, :, offsets[r] : offsets[r] + d]``.

Nodes
    A trie node stands for a token prefix; its ``depth`` is the prefix length. A node may
    point at a ``(block, row)`` whose first ``depth`` positions are its states. Attention is
    causal, so the first ``d`` positions of *any* row are the states of that row's first
    ``d`` tokens: a node that points at nothing can be resumed from the row of any
    descendant. The trie keeps the invariant that every node other than the root either
    points at a block or has a descendant that does (nodes that would break it are pruned),
    so the deepest node matching a prompt always yields its states.

Redundant rows
    When a node that ends a row gets a child, the child's row holds every state of the older
    row, so the older row's nodes let go of it; a block whose rows are all redundant is
    released at once. Lockstep particles therefore keep about one block alive, not one per
    step.

Memory bound
    ``max_bytes`` bounds the summed size of the blocks the trie keeps (keys and values of
    every layer, padding included). Blocks are kept in least-recently-used order: a block is
    used when it is created and whenever a forward pass resumes from one of its rows. The
    backend calls :meth:`KVTrie.evict` after each batch: the least recently used blocks are
    dropped until the total fits, their nodes are detached, and nodes left with no states and
    no children are pruned (walking up, iteratively). A block that no node points at any more
    (every node moved on to a newer block) is released at once. Between two evictions the
    blocks created by one batch may exceed the bound.

Every walk here is a loop, never a recursion, so 100k-token contexts are fine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

__all__ = ["KVBlock", "KVSource", "KVTrie", "gather_past"]

KV = tuple[torch.Tensor, torch.Tensor]


class _Node:
    __slots__ = ("block", "children", "depth", "key", "parent", "row", "token")

    def __init__(self, parent: _Node | None, token: int, depth: int):
        self.parent = parent
        self.token = token
        self.depth = depth
        self.children: dict[int, _Node] | None = None
        self.block: KVBlock | None = None
        self.row = -1
        self.key: tuple[int, ...] | None = None  # set when the node is in its trie's index


class KVBlock:
    """The key/value states left by one forward pass (see the module docstring)."""

    __slots__ = ("adapter", "layers", "nodes", "num_bytes", "offsets")

    def __init__(self, layers: list[KV], offsets: Sequence[int], adapter: Hashable):
        self.layers = layers
        self.offsets = list(offsets)
        self.adapter = adapter
        self.nodes: set[_Node] = set()
        self.num_bytes = sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers
        )

    @property
    def num_rows(self) -> int:
        return self.layers[0][0].shape[0]

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[-2]


class KVSource(NamedTuple):
    """Where the states of a cached prefix of ``length`` tokens are read from."""

    block: KVBlock
    row: int
    length: int


class _Prefixes:
    """The trie of one adapter: a root and an index from whole prompts to their nodes."""

    __slots__ = ("index", "root")

    def __init__(self) -> None:
        self.root = _Node(None, -1, 0)
        self.index: dict[tuple[int, ...], _Node] = {}


class KVTrie:
    """Token-prefix tries (one per adapter) over key/value blocks, bounded by ``max_bytes``.

    Not thread-safe: the backend uses it from its engine thread under a lock.

    Args:
        max_bytes: the most bytes of key/value tensors kept after each :meth:`evict`.
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self.max_bytes = int(max_bytes)
        self._tries: dict[Hashable, _Prefixes] = {}
        self._blocks: OrderedDict[KVBlock, None] = OrderedDict()
        self.num_bytes = 0
        self.num_evicted_blocks = 0
        self.num_oversized_blocks = 0

    # ---- reading ---------------------------------------------------------------------

    def lookup(
        self, adapter: Hashable, token_ids: tuple[int, ...], max_depth: int
    ) -> tuple[_Node, KVSource | None]:
        """The deepest node matching ``token_ids[:max_depth]``, and where its states are.

        Returns ``(node, source)``; ``source`` is None when nothing is cached (depth 0).
        """
        prefixes = self._tries.get(adapter)
        if prefixes is None:
            prefixes = self._tries[adapter] = _Prefixes()
        node = prefixes.index.get(
            token_ids if max_depth == len(token_ids) else token_ids[:max_depth]
        )
        if node is None:
            node = prefixes.root
            for token in token_ids[:max_depth]:
                child = node.children.get(token) if node.children else None
                if child is None:
                    break
                node = child
        if node.depth == 0:
            return node, None
        holder = node
        while holder.block is None:  # the invariant guarantees a descendant with states
            holder = next(iter(holder.children.values()))
        return node, KVSource(holder.block, holder.row, node.depth)

    # ---- writing ---------------------------------------------------------------------

    def add_block(self, block: KVBlock) -> None:
        """Registers a new block as the most recently used."""
        self._blocks[block] = None
        self.num_bytes += block.num_bytes
        if block.num_bytes > self.max_bytes > 0:
            self.num_oversized_blocks += 1

    def touch(self, block: KVBlock) -> None:
        """Marks ``block`` as just used (it moves to the end of the eviction order)."""
        if block in self._blocks:
            self._blocks.move_to_end(block)

    def insert(
        self, start: _Node, token_ids: tuple[int, ...], end: int, block: KVBlock, row: int
    ) -> None:
        """Points the nodes of ``token_ids[start.depth:end]`` below ``start`` at ``(block, row)``.

        Missing nodes are created; existing ones move to the newer block. The node at
        ``end`` is indexed by ``token_ids[:end]`` for fast lookups of its extensions.
        """
        if start.block is not None and end > start.depth:
            self._retire_row_ending_at(start)
        node = start
        for depth in range(start.depth, end):
            token = token_ids[depth]
            if node.children is None:
                node.children = {}
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node(node, token, depth + 1)
                child.block, child.row = block, row
                block.nodes.add(child)
            else:
                self._point(child, block, row)
            node = child
        if node.key is None and node.depth > 0:
            key = token_ids if end == len(token_ids) else token_ids[:end]
            prefixes = self._tries.get(block.adapter)
            if prefixes is not None and prefixes.index.setdefault(key, node) is node:
                node.key = key

    def _retire_row_ending_at(self, node: _Node) -> None:
        """Detaches the row that ``node`` ends, once ``node`` gets a child with states.

        Every node of that row is then an ancestor of the child, whose row holds the same
        states, so the older row is redundant. Without this, lockstep particles would keep one
        block per step until eviction; with it they keep about one, like a hand-written loop.
        """
        block, row = node.block, node.row
        if node.children and any(c.block is block and c.row == row for c in node.children.values()):
            return  # the row goes on below this node
        prefixes = self._tries.get(block.adapter)
        while node is not None and node.block is block and node.row == row:
            node.block, node.row = None, -1
            block.nodes.discard(node)
            if node.key is not None and prefixes is not None:  # the index serves the frontier only
                prefixes.index.pop(node.key, None)
                node.key = None
            node = node.parent
        if not block.nodes:
            self._release(block)

    def _point(self, node: _Node, block: KVBlock, row: int) -> None:
        old = node.block
        if old is block:
            node.row = row
            return
        if old is not None:
            old.nodes.discard(node)
            if not old.nodes:
                self._release(old)
        node.block, node.row = block, row
        block.nodes.add(node)

    def _release(self, block: KVBlock) -> None:
        if block in self._blocks:
            del self._blocks[block]
            self.num_bytes -= block.num_bytes

    # ---- forgetting ------------------------------------------------------------------

    def evict(self) -> int:
        """Drops least recently used blocks until at most ``max_bytes`` are kept.

        Returns the number of blocks dropped.
        """
        num_dropped = 0
        while self.num_bytes > self.max_bytes and self._blocks:
            block, _ = self._blocks.popitem(last=False)
            self.num_bytes -= block.num_bytes
            self._detach(block)
            num_dropped += 1
        self.num_evicted_blocks += num_dropped
        return num_dropped

    def _detach(self, block: KVBlock) -> None:
        nodes, block.nodes = block.nodes, set()
        for node in nodes:
            node.block, node.row = None, -1
        prefixes = self._tries.get(block.adapter)
        for node in nodes:
            self._prune(node, prefixes)

    @staticmethod
    def _prune(node: _Node, prefixes: _Prefixes | None) -> None:
        """Removes ``node`` and its ancestors while they hold no states and no children."""
        while node.parent is not None and node.block is None and not node.children:
            parent = node.parent
            del parent.children[node.token]
            node.parent = None
            if node.key is not None and prefixes is not None:
                prefixes.index.pop(node.key, None)
                node.key = None
            node = parent

    def clear(self) -> None:
        """Forgets every state of every adapter."""
        for block in self._blocks:
            self._forget(block)
        self._blocks.clear()
        self._tries.clear()
        self.num_bytes = 0

    def clear_adapter(self, adapter: Hashable) -> None:
        """Forgets the states computed with ``adapter`` (None: the base model)."""
        for block in [b for b in self._blocks if b.adapter == adapter]:
            del self._blocks[block]
            self.num_bytes -= block.num_bytes
            self._forget(block)
        self._tries.pop(adapter, None)

    @staticmethod
    def _forget(block: KVBlock) -> None:
        for node in block.nodes:
            node.block = None
        block.nodes = set()

    # ---- introspection ---------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)


def gather_past(sources: Sequence[KVSource | None], width: int) -> tuple[list[KV] | None, bool]:
    """The past states of a batch, each row right-aligned in ``width`` positions.

    Row ``i`` holds ``width - length_i`` padding positions (garbage values, to be masked out)
    followed by the states of source ``i``. Rows whose sources share a block should be
    adjacent, so that each block is read with one indexing operation per layer.

    Returns:
        ``(layers, is_padded)``: the ``(keys, values)`` per layer (None when ``width`` is 0)
        and whether any row is padded (the forward pass then needs an attention mask).
    """
    if width == 0:
        return None, False
    runs: list[tuple[KVBlock | None, list[KVSource | None]]] = []
    for source in sources:
        block = source.block if source is not None else None
        if runs and runs[-1][0] is block:
            runs[-1][1].append(source)
        else:
            runs.append((block, [source]))
    template = next(s.block for s in sources if s is not None)
    readers = [_run_reader(block, members, width) for block, members in runs]
    layers = []
    for layer in range(len(template.layers)):
        keys, values = [], []
        for (block, members), read in zip(runs, readers):
            if block is None:
                k0, v0 = template.layers[layer]
                shape = (len(members), k0.shape[1], width, k0.shape[3])
                keys.append(k0.new_zeros(shape))
                values.append(v0.new_zeros((len(members), v0.shape[1], width, v0.shape[3])))
            else:
                k, v = block.layers[layer]
                keys.append(read(k))
                values.append(read(v))
        layers.append(
            (keys[0], values[0]) if len(keys) == 1 else (torch.cat(keys), torch.cat(values))
        )
    is_padded = any(s is None or s.length != width for s in sources)
    return layers, is_padded


def _run_reader(block: KVBlock | None, members: list[KVSource | None], width: int):
    """A function reading the rows of ``members`` out of one layer tensor of ``block``."""
    if block is None:
        return None
    rows = [s.row for s in members]
    offsets = [block.offsets[r] for r in rows]
    device = block.layers[0][0].device
    if all(s.length == width for s in members) and all(o == offsets[0] for o in offsets):
        start = offsets[0]
        if rows == list(range(block.num_rows)):
            if start == 0 and width == block.length:
                return lambda t: t
            return lambda t: t[:, :, start : start + width]
        index = torch.tensor(rows, device=device)
        return lambda t: t[:, :, start : start + width].index_select(0, index)
    # General case: per-row starts. Position j of row i reads offset_i + length_i - width + j
    # (clamped: the clamped positions are padding and get masked out).
    row_index = torch.tensor(rows, device=device)[:, None]
    starts = torch.tensor([o + s.length - width for o, s in zip(offsets, members)], device=device)
    positions = (starts[:, None] + torch.arange(width, device=device)).clamp_(0, block.length - 1)
    return lambda t: t[row_index, :, positions].transpose(1, 2)
