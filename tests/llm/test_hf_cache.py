"""The seam to transformers' cache internals fails loudly if transformers changes its layout."""

from __future__ import annotations

import pytest
import torch
from hf_fixtures import random_prompt, shared_tiny_llama

from genlm_backend.llm.hf.cache import accepts_logits_to_keep, make_past, read_past


@pytest.fixture
def hf_model():
    return shared_tiny_llama()


def test_made_cache_equals_one_built_by_transformers(hf_model):
    """A forward pass resumed from ``make_past`` equals one resumed from transformers' own cache."""
    from transformers import DynamicCache

    prompt = random_prompt(12, seed=30)
    with torch.no_grad():
        first = hf_model(torch.tensor([prompt[:8]]), past_key_values=DynamicCache(), use_cache=True)
        layers = read_past(first.past_key_values)
        assert len(layers) == hf_model.config.num_hidden_layers
        keys, values = layers[0]
        assert keys.shape == (1, hf_model.config.num_key_value_heads, 8, 16) == values.shape
        ours = make_past([(k.clone(), v.clone()) for k, v in layers])
        assert ours.get_seq_length() == 8
        theirs = DynamicCache()
        for i, (k, v) in enumerate(layers):
            theirs.update(k.clone(), v.clone(), i)
        rest = torch.tensor([prompt[8:]])
        a = hf_model(rest, past_key_values=ours, use_cache=True)
        b = hf_model(rest, past_key_values=theirs, use_cache=True)
    assert torch.equal(a.logits, b.logits)
    for (ka, va), (kb, vb) in zip(read_past(a.past_key_values), read_past(b.past_key_values)):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert ka.shape[-2] == 12


def test_made_cache_does_not_modify_the_tensors_it_holds(hf_model):
    prompt = random_prompt(6, seed=31)
    with torch.no_grad():
        layers = read_past(hf_model(torch.tensor([prompt]), use_cache=True).past_key_values)
        before = [(k.clone(), v.clone()) for k, v in layers]
        hf_model(torch.tensor([[1, 2]]), past_key_values=make_past(layers), use_cache=True)
    for (k, v), (k0, v0) in zip(layers, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_empty_past_and_logits_to_keep(hf_model):
    assert make_past(None).get_seq_length() == 0
    assert accepts_logits_to_keep(hf_model)
    assert not accepts_logits_to_keep(torch.nn.Linear(2, 2))
