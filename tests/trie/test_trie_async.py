"""The async trie: batching of concurrent awaits, per-caller errors, lifecycle."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from hypothesis import given, settings

from genlm_backend.exceptions import ClosedError, EngineError, InvalidRequestError
from genlm_backend.tokenization import Token
from genlm_backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
)
from tests.trie.strategies import EndOfSequence, vocab_and_weights

VOCAB = [b"a", b"ab", b"b", b"", b"ab", b"\xc3\xa9"]


def gather(*aws):
    return asyncio.gather(*aws, return_exceptions=True)


@pytest.mark.parametrize("backend", ["parallel", "sequential"])
async def test_concurrent_awaits_are_batched_and_match_the_sync_trie(backend):
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend=backend)
    rng = np.random.default_rng(0)
    probs = [torch.from_numpy(rng.dirichlet(np.ones(len(VOCAB)))).float() for _ in range(12)]
    logs = [p.log() for p in probs]
    results = await asyncio.gather(
        *[trie.weight_sum(p) for p in probs], *[trie.weight_max(lw) for lw in logs]
    )
    assert trie.stats.num_requests == 24 and trie.stats.num_batches <= 2
    for p, got in zip(probs, results[:12]):
        torch.testing.assert_close(got, trie.trie.weight_sum(p))
    for lw, got in zip(logs, results[12:]):
        assert torch.equal(got, trie.trie.weight_max(lw))
    await trie.cleanup()


@settings(max_examples=25)
@given(vocab_and_weights(batch=4, log=True))
def test_sequential_parallel_and_async_agree(case):
    vocab, ws = case
    sequential = TokenCharacterTrie(vocab)

    async def run():
        async with AsyncTokenCharacterTrie(ParallelTokenCharacterTrie(vocab)) as trie:
            return await asyncio.gather(
                *[trie.weight_max(row) for row in ws],
                *[trie.weight_sum(np.exp(row)) for row in ws],
            )

    results = asyncio.run(run())
    for row, got in zip(ws, results[:4]):
        np.testing.assert_array_equal(got, sequential.weight_max(row))
    for row, got in zip(ws, results[4:]):
        np.testing.assert_allclose(got, sequential.weight_sum(np.exp(row)), rtol=1e-12, atol=0)


async def test_mixed_input_types_in_one_batch_keep_their_own_result_types():
    trie = AsyncTokenCharacterTrie(ParallelTokenCharacterTrie(VOCAB))
    ws = np.linspace(0.1, 0.6, len(VOCAB))
    inputs = [
        ws,
        ws.astype(np.float32),
        list(ws),
        torch.from_numpy(ws),
        torch.from_numpy(ws).float(),
    ]
    results = await asyncio.gather(*[trie.weight_sum(x) for x in inputs])
    assert [type(r) for r in results] == [np.ndarray] * 3 + [torch.Tensor] * 2
    assert [r.dtype for r in results[3:]] == [torch.float64, torch.float32]
    for r in results:
        np.testing.assert_allclose(np.asarray(r, dtype=np.float64), results[0], rtol=1e-6)
    trie.shutdown()


async def test_bad_input_reaches_only_its_caller():
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB)
    good = torch.ones(len(VOCAB))
    results = await gather(
        trie.weight_sum(good),
        trie.weight_sum(torch.ones(3)),
        trie.weight_max(torch.tensor([0.0, float("nan"), 0, 0, 0, 0])),
        trie.weight_sum(torch.ones(2, len(VOCAB))),
        trie.weight_max(good),
    )
    assert isinstance(results[0], torch.Tensor) and results[0][0] == len(VOCAB)
    for error in results[1:4]:
        assert isinstance(error, InvalidRequestError) and isinstance(error, ValueError)
    assert isinstance(results[4], torch.Tensor) and results[4][0] == 1
    await trie.cleanup()


async def test_a_failing_batch_fails_its_callers_and_the_trie_keeps_working(monkeypatch):
    trie = AsyncTokenCharacterTrie(TokenCharacterTrie(VOCAB))
    original = trie.trie.batch_weight_sum
    calls = []

    def flaky(ws):
        calls.append(len(ws))
        if len(calls) == 1:
            raise RuntimeError("device lost")
        return original(ws)

    monkeypatch.setattr(trie.trie, "batch_weight_sum", flaky)
    ws = np.ones(len(VOCAB))
    first = await gather(trie.weight_sum(ws), trie.weight_sum(ws), trie.weight_max(ws))
    assert all(isinstance(e, EngineError) for e in first[:2])
    assert "device lost" in str(first[0]) and isinstance(first[0].__cause__, RuntimeError)
    assert isinstance(first[2], np.ndarray)  # the max stack of the same batch succeeded
    second = await trie.weight_sum(ws)
    assert second[0] == len(VOCAB)
    await trie.cleanup()


async def test_cleanup_is_idempotent_and_later_calls_raise():
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="sequential")
    await trie.weight_sum(np.ones(len(VOCAB)))
    await trie.cleanup()
    await trie.cleanup()
    trie.shutdown()
    with pytest.raises(ClosedError):
        await trie.weight_sum(np.ones(len(VOCAB)))
    with AsyncTokenCharacterTrie.from_vocab(VOCAB) as other:
        assert (await other.weight_max([1, 2, 3, 4, 5, 6]))[0] == 6
    with pytest.raises(ClosedError):
        await other.weight_max(np.ones(len(VOCAB)))


def test_unknown_backend_and_non_trie_are_rejected():
    with pytest.raises(ValueError, match="backend"):
        AsyncTokenCharacterTrie.from_vocab(VOCAB, backend="gpu")
    with pytest.raises(TypeError):
        AsyncTokenCharacterTrie(VOCAB)


def test_works_across_event_loops():
    trie = AsyncTokenCharacterTrie.from_vocab(VOCAB)
    for _ in range(2):
        assert asyncio.run(trie.weight_sum(np.ones(len(VOCAB))))[0] == len(VOCAB)
    trie.shutdown()


async def test_a_constrained_sampler_can_use_it_as_it_does():
    """How genlm-control's trie set samplers build and walk the trie: Tokens whose ids are
    not their positions, an EOS object last, probabilities in, per-node masses out."""
    eos = EndOfSequence()
    words = [b"a", b"ab", b"b", b"abc"]
    vocab = [Token(token_id=10 + i, byte_string=w) for i, w in enumerate(words)] + [eos]
    executor = AsyncTokenCharacterTrie(ParallelTokenCharacterTrie(vocab))
    trie = executor.trie
    leaf_to_position = {
        trie.word2leaf[(t.byte_string, t.token_id) if isinstance(t, Token) else t]: i
        for i, t in enumerate(vocab)
    }
    probs = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float32)
    masses = await executor.weight_sum(probs)
    log_max = await executor.weight_max(probs.log())
    assert masses[trie.root] == pytest.approx(1.0)
    # walk "ab" then take the leaf: the mass of node "ab" is p(ab) + p(abc)
    node = trie.children[trie.children[trie.root][ord("a")]][ord("b")]
    assert masses[node] == pytest.approx(0.2 + 0.15)
    leaves = [c for label, c in trie.children[node].items() if isinstance(label, tuple)]
    assert [leaf_to_position[leaf] for leaf in leaves] == [1]
    assert masses[trie.children[trie.root][eos]] == pytest.approx(0.25)
    assert log_max[trie.root] == pytest.approx(np.log(0.3))
    await executor.cleanup()
