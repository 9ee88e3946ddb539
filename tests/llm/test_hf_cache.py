"""The seam to transformers' cache internals fails loudly if transformers changes its layout,
and the backend calls no transformers API that the installed version deprecates."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from hf_fixtures import (
    load_tiny_llama,
    lora_dir,
    merged_model,
    random_prompt,
    reference_logprobs,
    shared_tiny_llama,
    tiny_tokenizer,
)

from genlm_backend.llm.hf import AsyncTransformer
from genlm_backend.llm.hf.kv_cache import (
    accepts_logits_to_keep,
    cache_argument,
    make_past,
    read_past,
    returned_cache,
)


@pytest.fixture
def hf_model():
    return shared_tiny_llama()


def test_made_cache_equals_one_built_by_transformers(hf_model):
    """A forward pass resumed from ``make_past`` equals one resumed from transformers' own cache."""
    from transformers import DynamicCache

    prompt = random_prompt(12, seed=30)
    name = cache_argument(hf_model)
    with torch.no_grad():
        first = hf_model(torch.tensor([prompt[:8]]), **{name: DynamicCache()}, use_cache=True)
        layers = read_past(returned_cache(first))
        assert len(layers) == hf_model.config.num_hidden_layers
        keys, values = layers[0]
        assert keys.shape == (1, hf_model.config.num_key_value_heads, 8, 16) == values.shape
        ours = make_past([(k.clone(), v.clone()) for k, v in layers])
        assert ours.get_seq_length() == 8
        theirs = DynamicCache()
        for i, (k, v) in enumerate(layers):
            theirs.update(k.clone(), v.clone(), i)
        rest = torch.tensor([prompt[8:]])
        a = hf_model(rest, **{name: ours}, use_cache=True)
        b = hf_model(rest, **{name: theirs}, use_cache=True)
    assert torch.equal(a.logits, b.logits)
    for (ka, va), (kb, vb) in zip(read_past(returned_cache(a)), read_past(returned_cache(b))):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert ka.shape[-2] == 12


def test_made_cache_does_not_modify_the_tensors_it_holds(hf_model):
    prompt = random_prompt(6, seed=31)
    with torch.no_grad():
        layers = read_past(returned_cache(hf_model(torch.tensor([prompt]), use_cache=True)))
        before = [(k.clone(), v.clone()) for k, v in layers]
        past = {cache_argument(hf_model): make_past(layers)}
        hf_model(torch.tensor([[1, 2]]), **past, use_cache=True)
    for (k, v), (k0, v0) in zip(layers, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)


def test_empty_past_and_logits_to_keep(hf_model):
    assert make_past(None).get_seq_length() == 0
    assert accepts_logits_to_keep(hf_model)
    assert not accepts_logits_to_keep(torch.nn.Linear(2, 2))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_a_wrapped_model_gets_the_cache_keyword_of_this_transformers(hf_model):
    """A module whose forward passes its keyword arguments on (a user's wrapper) names neither
    keyword: it gets the one the installed transformers' own models take."""
    from genlm_backend.llm.hf.kv_cache import cache_argument

    class PassesKeywordsOn(torch.nn.Module):
        def forward(self, input_ids, **kwargs):
            return hf_model(input_ids=input_ids, **kwargs)

    assert cache_argument(PassesKeywordsOn()) == cache_argument(hf_model)


def test_backend_calls_no_deprecated_transformers_api(hf_model):
    """Every forward-pass shape of the backend (fresh prompts, padded cached states, one-token
    extensions, a LoRA adapter through peft) under warnings that are errors: a transformers
    deprecation (a FutureWarning or DeprecationWarning, or a "deprecated" log line, which
    transformers logs once per process, hence the cleared once-cache) fails this test, so a
    renamed argument is found while the old name still works. Loading the adapter runs
    outside: peft's own calls into transformers are not the backend's."""
    expected = reference_logprobs(merged_model("a"), random_prompt(9, seed=49) + [5, 6])
    lm = AsyncTransformer(load_tiny_llama(), tiny_tokenizer())  # its own: peft modifies it
    lm.add_new_lora(lora_dir("a"), "a")
    transformers_logger = logging.getLogger("transformers")
    records = _Records()
    transformers_logger.addHandler(records)
    once = getattr(logging.Logger, "warning_once", None)  # transformers' once-per-message log
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    prompts = [random_prompt(n, seed=40 + n) for n in (3, 9, 17)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            first = lm.batch_next_token_logprobs_sync(prompts)  # fresh prompts, right-padded
            longer = [p + [7] for p in prompts]  # cached states of three widths: padded past
            second = lm.batch_next_token_logprobs_sync(longer)
            adapted = lm.next_token_logprobs_sync(prompts[1] + [5, 6], lora_name="a")
    finally:
        transformers_logger.removeHandler(records)
        lm.cleanup()
    deprecated = [m for m in records.messages if "deprecat" in m.lower()]
    assert not deprecated, deprecated
    for row, prompt in zip([*first, *second], [*prompts, *longer]):
        assert (row - reference_logprobs(hf_model, prompt)).abs().max() <= 1e-5
    assert (adapted - expected).abs().max() <= 1e-5
