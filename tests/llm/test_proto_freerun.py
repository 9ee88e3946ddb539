"""``benchmarks/proto_freerun.py``: the free-running bound hands each particle the rows of
its own context, with the token vLLM drew from each."""

from __future__ import annotations

import importlib.util

import pytest
from vllm_fixtures import assert_matches

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


def test_free_running_particles_get_the_rows_of_their_contexts(vlm, hf_reference):
    """Every row a particle gets is the transformers row of its context at that step, and the
    particle's tokens are draws vLLM could make from those rows (finite log-probability)."""
    from benchmarks.proto_freerun import free_running

    vlm.set_sessions(False)
    prompt = [5, 900, 31000, 7, 8]
    kept = []
    tokens = free_running(vlm, prompt, 3, 5, seed=0, kept_rows=kept)
    assert [len(t) for t in tokens] == [5, 5, 5]
    assert len(kept) == 15
    for context, row in kept:
        assert_matches(row, hf_reference("base", context))
    for particle_tokens in tokens:
        context = list(prompt)
        for token in particle_tokens:
            row = next(r for c, r in kept if c == context)
            assert row[token].item() > float("-inf")
            context.append(token)
