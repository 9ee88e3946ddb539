"""The tries on real vocabularies: the 32k SentencePiece and the 131k tekken tokenizers,
decoded with ``decode_vocab``, against a reference that accumulates every token's weight
into a dict keyed by each of its byte prefixes (no trie involved).

Tolerance: both sides add float64 values in different orders, so sums agree to ``1e-9``
times the total magnitude below a node; maxima are exact.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch

from genlm_backend.trie import ParallelTokenCharacterTrie, TokenCharacterTrie
from tests.trie.reference import node_prefixes


def prefix_tables(vocab, ws):
    """``prefix -> (sum, max, sum of magnitudes)`` over the tokens that start with it."""
    total = defaultdict(float)
    largest = defaultdict(lambda: -np.inf)
    magnitude = defaultdict(float)
    for item, w in zip(vocab, ws.tolist()):
        data = bytes(item)
        for k in range(len(data) + 1):
            prefix = data[:k]
            total[prefix] += w
            magnitude[prefix] += abs(w)
            largest[prefix] = max(largest[prefix], w)
    return total, largest, magnitude


@pytest.mark.parametrize("family", ["sentencepiece", "tekken"])
def test_real_vocabulary(byte_vocab, family):
    vocab = byte_vocab(family)
    trie = TokenCharacterTrie(vocab)
    prefixes, leaves = node_prefixes(trie)
    distinct = {bytes(t)[:k] for t in vocab for k in range(len(t) + 1)}
    assert len(prefixes) == len(distinct) and len(leaves) == len(vocab)
    assert all(leaves[trie.word2leaf[(t.byte_string, t.token_id)]] == t.token_id for t in vocab)

    rng = np.random.default_rng(sum(map(ord, family)))
    ws = rng.normal(size=len(vocab)) * np.exp(rng.normal(scale=8, size=len(vocab)))
    total, largest, magnitude = prefix_tables(vocab, ws)
    sums, maxima = trie.weight_sum(ws), trie.weight_max(ws)
    nodes = np.fromiter(prefixes, dtype=np.int64, count=len(prefixes))
    want_sum = np.array([total[bytes(prefixes[n])] for n in nodes])
    want_max = np.array([largest[bytes(prefixes[n])] for n in nodes])
    scale = np.array([magnitude[bytes(prefixes[n])] for n in nodes])
    assert np.all(np.abs(sums[nodes] - want_sum) <= 1e-9 * scale)
    np.testing.assert_array_equal(maxima[nodes], want_max)
    leaf_ids = np.fromiter(leaves, dtype=np.int64, count=len(leaves))
    positions = np.fromiter(leaves.values(), dtype=np.int64, count=len(leaves))
    np.testing.assert_array_equal(sums[leaf_ids], ws[positions])

    batch = np.stack([ws, -ws, np.abs(ws)])
    for strategy in ("levels", "flat", "auto"):  # auto: the compiled kernel, if built
        parallel = ParallelTokenCharacterTrie(vocab, strategy=strategy)
        got = parallel.batch_weight_sum(torch.from_numpy(batch))
        np.testing.assert_allclose(got[0].numpy(), sums, rtol=0, atol=1e-9 * scale.max())
        np.testing.assert_array_equal(parallel.weight_max(ws), maxima)
        got32 = parallel.batch_weight_max(torch.from_numpy(batch).float())
        want32 = trie.weight_max(batch[1].astype(np.float32)).astype(np.float32)
        np.testing.assert_array_equal(got32[1].numpy(), want32)
