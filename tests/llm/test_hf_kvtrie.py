"""The key/value trie on its own: lookups, reading states back, eviction, deep contexts.

Blocks here hold labelled tensors instead of real states: position ``p`` of row ``r`` of a
block labelled ``b`` holds ``b * 1e6 + r * 1e3 + p``, so every value read back names where
it came from.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hf_fixtures import trie_nodes
from hypothesis import given, settings
from hypothesis import strategies as st

from genlm_backend.llm.hf.kvtrie import KVBlock, KVSource, KVTrie, gather_past

NUM_LAYERS = 2


def labelled_block(label: int, rows: int, length: int, offsets=None, adapter=None) -> KVBlock:
    r = torch.arange(rows, dtype=torch.float64)[:, None]
    p = torch.arange(length, dtype=torch.float64)[None, :]
    values = (label * 1e6 + r * 1e3 + p)[:, None, :, None]  # [rows, heads=1, length, dim=1]
    layers = [(values + layer * 0.5, -(values + layer * 0.5)) for layer in range(NUM_LAYERS)]
    return KVBlock(layers, offsets or [0] * rows, adapter)


def store(kv: KVTrie, prompts: list[tuple[int, ...]], label: int, adapter=None) -> KVBlock:
    """Pretends one forward pass computed ``prompts`` from scratch (no padding)."""
    length = max(len(p) for p in prompts)
    block = labelled_block(label, len(prompts), length, adapter=adapter)
    kv.add_block(block)
    for row, prompt in enumerate(prompts):
        node, _ = kv.lookup(adapter, prompt, 0)
        kv.insert(node, prompt, len(prompt), block, row)
    return block


def read_back(source: KVSource, width: int) -> list[float]:
    layers, _ = gather_past([source], width)
    return layers[0][0][0, 0, :, 0].tolist()


def test_lookup_finds_the_longest_cached_prefix():
    kv = KVTrie(max_bytes=1 << 30)
    store(kv, [(1, 2, 3, 4), (1, 2, 9)], label=1)
    node, source = kv.lookup(None, (1, 2, 3, 4, 5), 5)
    assert node.depth == 4 and source.length == 4 and source.row == 0
    assert read_back(source, 4) == [1e6 + p for p in range(4)]
    node, source = kv.lookup(None, (1, 2, 9, 9), 3)
    assert source.row == 1 and source.length == 3
    _, source = kv.lookup(None, (7, 8), 2)
    assert source is None
    # max_depth caps the match: a prompt that is fully cached still runs its last token.
    node, source = kv.lookup(None, (1, 2, 3, 4), 3)
    assert node.depth == 3 and source.length == 3
    # Adapters have separate tries.
    assert kv.lookup("lora", (1, 2, 3, 4), 4)[1] is None


def test_a_block_whose_nodes_all_moved_on_is_released():
    kv = KVTrie(max_bytes=1 << 30)
    store(kv, [(1, 2, 3)], label=1)
    node, _ = kv.lookup(None, (1, 2, 3, 4, 5), 3)
    later = labelled_block(2, 1, 5)
    kv.add_block(later)
    kv.insert(node, (1, 2, 3, 4, 5), 5, later, 0)  # the suffix 4, 5 lives in block 2
    # Move (1, 2, 3)'s nodes to block 2 as well, as a newer pass over them would, so that
    # block 1 is released; prefixes are then read from block 2's row.
    root_node, _ = kv.lookup(None, (1, 2, 3, 4, 5), 0)
    kv.insert(root_node, (1, 2, 3, 4, 5), 5, later, 0)
    assert kv.num_blocks == 1
    _, source = kv.lookup(None, (1, 2, 7), 2)
    assert source.block is later and read_back(source, 2) == [2e6, 2e6 + 1]


def test_eviction_is_least_recently_used_and_prunes_nodes():
    block_bytes = labelled_block(0, 1, 4).num_bytes
    kv = KVTrie(max_bytes=2 * block_bytes)
    a = store(kv, [(1, 1, 1, 1)], label=1)
    store(kv, [(2, 2, 2, 2)], label=2)
    kv.touch(a)  # a is now more recent than b
    store(kv, [(3, 3, 3, 3)], label=3)
    assert kv.evict() == 1
    assert kv.lookup(None, (1, 1, 1, 1), 4)[1] is not None
    assert kv.lookup(None, (2, 2, 2, 2), 4)[1] is None
    assert kv.lookup(None, (3, 3, 3, 3), 4)[1] is not None
    assert trie_nodes(kv) == 8  # the evicted prompt's 4 nodes were pruned
    assert kv.num_bytes == 2 * block_bytes
    kv.max_bytes = 0
    kv.evict()
    assert trie_nodes(kv) == 0 and kv.num_bytes == 0 and kv.num_blocks == 0


def test_evicting_a_prefix_block_keeps_nodes_with_states_below():
    block_bytes = labelled_block(0, 1, 4).num_bytes
    kv = KVTrie(max_bytes=10 * block_bytes)
    store(kv, [(1, 2, 3, 4)], label=1)
    node, _ = kv.lookup(None, (1, 2, 3, 4, 5), 4)
    child = labelled_block(2, 1, 5)
    kv.add_block(child)
    kv.insert(node, (1, 2, 3, 4, 5), 5, child, 0)
    kv.max_bytes = child.num_bytes
    kv.evict()  # block 1 goes; nodes 1..4 stay (their descendant holds states)
    assert trie_nodes(kv) == 5
    node, source = kv.lookup(None, (1, 2, 3, 9), 3)
    assert node.depth == 3 and source.block is child
    assert read_back(source, 3) == [2e6, 2e6 + 1, 2e6 + 2]


def test_gather_reads_rows_with_offsets_and_pads_on_the_left():
    kv = KVTrie(max_bytes=1 << 30)
    block = labelled_block(3, 3, 6, offsets=[0, 2, 1])
    kv.add_block(block)
    sources = [KVSource(block, 1, 3), KVSource(block, 2, 4), None]
    layers, is_padded = gather_past(sources, 4)
    assert is_padded and len(layers) == NUM_LAYERS
    keys, values = layers[1]
    assert keys.shape == (3, 1, 4, 1)
    row0 = keys[0, 0, :, 0].tolist()
    assert row0[1:] == [3e6 + 1e3 + p + 0.5 for p in (2, 3, 4)]  # offset 2, 3 positions
    assert keys[1, 0, :, 0].tolist() == [3e6 + 2e3 + p + 0.5 for p in (1, 2, 3, 4)]
    assert torch.equal(values[1], -keys[1])  # values are read from the same places
    assert keys[2].abs().sum() == 0  # no source: zeros (masked)


def test_gather_fast_paths_share_or_select_rows():
    block = labelled_block(4, 3, 5)
    whole = [KVSource(block, r, 5) for r in range(3)]
    layers, is_padded = gather_past(whole, 5)
    assert not is_padded
    assert layers[0][0] is block.layers[0][0]  # all rows in order: no copy at all
    layers, _ = gather_past([KVSource(block, 2, 3), KVSource(block, 2, 3)], 3)
    assert layers[0][0][:, 0, :, 0].tolist() == [[4e6 + 2e3 + p for p in range(3)]] * 2


@settings(max_examples=60)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
    st.integers(0, 6),
)
def test_random_workloads_keep_the_invariants(prompts, capacity_blocks):
    """Whatever is stored and evicted, every lookup reads exactly its own prefix's states."""
    block_bytes = labelled_block(0, 1, 8).num_bytes
    kv = KVTrie(max_bytes=capacity_blocks * block_bytes)
    computed: dict[tuple, set[int]] = {}  # prefix -> labels of the blocks that computed it
    for label, prompt in enumerate(prompts, start=1):
        prompt = tuple(prompt)
        node, source = kv.lookup(None, prompt, len(prompt))
        if source is not None:  # what we read must be a prefix of something we computed
            values = read_back(source, source.length)
            assert [v % 1e3 for v in values] == list(range(source.length))
            assert int(values[0] // 1e6) in computed[prompt[: source.length]]
        block = labelled_block(label, 1, len(prompt))
        kv.add_block(block)
        kv.insert(node, prompt, len(prompt), block, 0)
        for depth in range(1, len(prompt) + 1):
            computed.setdefault(prompt[:depth], set()).add(label)
        kv.evict()
        assert kv.num_bytes <= kv.max_bytes
        assert kv.num_bytes == sum(b.num_bytes for b in kv._blocks)


def test_deep_contexts_use_no_recursion():
    depth = 50_000
    prompt = tuple(i % 7 for i in range(depth))
    kv = KVTrie(max_bytes=1 << 40)
    block = labelled_block(1, 1, 1)  # tiny tensors; only the node walk matters here
    kv.add_block(block)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)  # a recursive walk would fail at once
    try:
        node, _ = kv.lookup(None, prompt, depth)
        kv.insert(node, prompt, depth, block, 0)
        node, _ = kv.lookup(None, prompt[:-1] + (99,), depth)
        assert node.depth == depth - 1
        assert trie_nodes(kv) == depth
        kv.max_bytes = 0
        kv.evict()  # prunes the whole chain
        assert trie_nodes(kv) == 0
        kv.add_block(block)
        kv.insert(kv.lookup(None, prompt, 0)[0], prompt, depth, block, 0)
        kv.clear()
        assert trie_nodes(kv) == 0
    finally:
        sys.setrecursionlimit(limit)


def test_clear_adapter_forgets_only_that_adapter():
    kv = KVTrie(max_bytes=1 << 30)
    store(kv, [(1, 2)], label=1, adapter=None)
    store(kv, [(1, 2)], label=2, adapter="a")
    kv.clear_adapter("a")
    assert kv.lookup("a", (1, 2), 2)[1] is None
    assert kv.lookup(None, (1, 2), 2)[1] is not None
    assert kv.num_blocks == 1


def test_negative_bound_is_refused():
    with pytest.raises(ValueError):
        KVTrie(max_bytes=-1)
