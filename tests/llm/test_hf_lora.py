"""LoRA adapters on AsyncTransformer, against merged models (base + adapter in the weights).

Tolerance 1e-4: the backend runs the adapter as a separate low-rank product (x·W + s·x·A·B)
while the reference has it folded into W; the two round differently, by a few 1e-6 in fp32
here. An adapter mix-up (wrong adapter, base states reused for an adapter) moves
log-probabilities by more than 1e-1.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from hf_fixtures import (
    load_tiny_llama,
    lora_dir,
    merged_model,
    random_prompt,
    reference_logprobs,
    tiny_tokenizer,
)

from genlm_backend.exceptions import InvalidRequestError
from genlm_backend.llm.hf import AsyncTransformer

TOL = 1e-4


def assert_close(row, expected, tol=TOL):
    diff = (row.cpu() - expected).abs().max().item()
    assert diff <= tol, f"max abs difference {diff} > {tol}"


def assert_far(row, expected):
    assert (row.cpu() - expected).abs().max().item() > 1e-2


@pytest.fixture(scope="module")
def base_model():
    """A model of this module's own: adapters are injected into it."""
    return load_tiny_llama()


@pytest.fixture(scope="module")
def reference_base():
    return load_tiny_llama()


@pytest.fixture
def lm(base_model):
    lm = AsyncTransformer(base_model, tiny_tokenizer())
    lm.add_new_lora(str(lora_dir("a")), "a")
    lm.add_new_lora(str(lora_dir("b")), "b")
    yield lm
    if not lm.is_closed:
        for name in list(lm._lora_paths):
            lm.remove_lora(name)
        lm.cleanup()


async def test_adapters_match_merged_models_in_one_batch(lm, reference_base):
    prompts = [random_prompt(20, seed=40), random_prompt(9, seed=41)]
    calls = [(p, name) for p in prompts for name in (None, "a", "b")]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p, lora_name=name) for p, name in calls))
    assert lm.stats()["num_batches"] == 1
    for (prompt, name), row in zip(calls, rows):
        reference = reference_base if name is None else merged_model(name)
        assert_close(row, reference_logprobs(reference, prompt))
    assert_far(rows[1], rows[0])  # the adapter matters


async def test_key_values_are_kept_per_adapter(lm, reference_base):
    prompt = random_prompt(30, seed=42)
    await lm.next_token_logprobs(prompt)  # states of the base model
    before = lm.stats()["num_forward_tokens"]
    row = await lm.next_token_logprobs(prompt + [5], lora_name="a")
    assert lm.stats()["num_forward_tokens"] == before + 31  # base states are not reused
    assert_close(row, reference_logprobs(merged_model("a"), prompt + [5]))
    row = await lm.next_token_logprobs(prompt + [5, 6], lora_name="a")
    assert lm.stats()["num_forward_tokens"] == before + 32  # the adapter's own are
    assert_close(row, reference_logprobs(merged_model("a"), prompt + [5, 6]))
    row = await lm.next_token_logprobs(prompt + [5])
    assert lm.stats()["num_forward_tokens"] == before + 33
    assert_close(row, reference_logprobs(reference_base, prompt + [5]))


async def test_output_cache_is_per_adapter(base_model, reference_base):
    with AsyncTransformer(base_model, tiny_tokenizer(), cache_size=16) as lm:
        lm.add_new_lora(str(lora_dir("a")), "a")
        prompt = random_prompt(8, seed=43)
        base_row = await lm.next_token_logprobs(prompt)
        adapter_row = await lm.next_token_logprobs(prompt, lora_name="a")
        assert lm.stats()["cache_hits"] == 0
        assert_far(adapter_row, base_row)
        again = await lm.next_token_logprobs(prompt, lora_name="a")
        assert lm.stats()["cache_hits"] == 1 and torch.equal(again, adapter_row)
        lm.remove_lora("a")


async def test_set_lora_and_clear_lora(lm, reference_base):
    prompt = random_prompt(12, seed=44)
    lm.set_lora(lora_name="b")
    assert_close(
        await lm.next_token_logprobs(prompt), reference_logprobs(merged_model("b"), prompt)
    )
    assert_close(
        await lm.next_token_logprobs(prompt, lora_name="a"),
        reference_logprobs(merged_model("a"), prompt),
    )
    lm.clear_lora()
    assert_close(await lm.next_token_logprobs(prompt), reference_logprobs(reference_base, prompt))
    assert_close(
        lm.next_token_logprobs_uncached(prompt, lora_name="b"),
        reference_logprobs(merged_model("b"), prompt),
    )


async def test_remove_lora(lm, base_model, reference_base):
    prompt = random_prompt(10, seed=45)
    await lm.next_token_logprobs(prompt, lora_name="a")
    lm.remove_lora("a")
    with pytest.raises(InvalidRequestError):
        await lm.next_token_logprobs(prompt, lora_name="a")
    assert_close(
        await lm.next_token_logprobs(prompt, lora_name="b"),
        reference_logprobs(merged_model("b"), prompt),
    )
    lm.remove_lora("b")
    # No adapter left: the plain model again, unchanged.
    assert type(lm.model).__name__ == "LlamaForCausalLM"
    assert_close(
        await lm.next_token_logprobs(prompt), reference_logprobs(reference_base, prompt), tol=1e-5
    )
    # And adapters can be added again.
    lm.add_new_lora(str(lora_dir("a")), "a")
    assert_close(
        await lm.next_token_logprobs(prompt, lora_name="a"),
        reference_logprobs(merged_model("a"), prompt),
    )


def test_bad_adapter_path_is_a_value_error(lm, tmp_path):
    with pytest.raises(ValueError):
        lm.add_new_lora(str(tmp_path / "missing"), "c")
    assert "c" not in lm._lora_paths
    assert_close(
        lm.next_token_logprobs_sync([1, 2, 3], lora_name="a"),
        reference_logprobs(merged_model("a"), [1, 2, 3]),
    )


# ---- mixed batches, and adapters removed while their requests wait -----------------------

HF_MIXES = {
    "a+none": [(41, "a"), (41, None)],
    "repeated": [(46, None), (46, "a"), (46, "b"), (46, None), (46, "a"), (47, "b"), (47, None)],
}


@pytest.mark.parametrize("mix", list(HF_MIXES))
async def test_mixed_batches_match_their_references(lm, reference_base, mix):
    calls = [(random_prompt(11 + seed % 5, seed=seed), name) for seed, name in HF_MIXES[mix]]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p, lora_name=name) for p, name in calls))
    assert lm.stats()["num_batches"] == 1
    for (prompt, name), row in zip(calls, rows):
        reference = reference_base if name is None else merged_model(name)
        assert_close(row, reference_logprobs(reference, prompt))


async def test_one_batch_extends_a_context_under_every_adapter(lm, reference_base):
    """Key/value states of one context kept per adapter, extended in one batch by all three."""
    prompt = random_prompt(16, seed=48)
    await asyncio.gather(
        *(lm.next_token_logprobs(prompt, lora_name=name) for name in (None, "a", "b"))
    )
    calls = [(prompt + [7], name) for name in ("b", None, "a")] + [(prompt + [7, 9], None)]
    rows = await asyncio.gather(*(lm.next_token_logprobs(p, lora_name=name) for p, name in calls))
    for (context, name), row in zip(calls, rows):
        reference = reference_base if name is None else merged_model(name)
        assert_close(row, reference_logprobs(reference, context))


REMOVAL_CALLS = [(50, None), (50, "a"), (51, "b"), (51, "a"), (52, None)]


@pytest.mark.parametrize("keep_b", [True, False], ids=["another-adapter-left", "last-adapter"])
async def test_removing_an_adapter_fails_only_its_queued_requests(lm, reference_base, keep_b):
    """The adapter goes between the requests' submission and their batch's evaluation: its
    requests get an error naming it (never the base model's rows); the others are exact."""
    calls = [
        (random_prompt(12, seed=seed), name)
        for seed, name in REMOVAL_CALLS
        if keep_b or name != "b"
    ]
    if not keep_b:
        lm.remove_lora("b")  # "a" is then the last adapter: removing it unloads peft
    tasks = [asyncio.ensure_future(lm.next_token_logprobs(p, lora_name=name)) for p, name in calls]
    await asyncio.sleep(0)  # every request is validated and queued; the batch starts after this
    batches_before = lm.stats()["num_batches"]
    lm.remove_lora("a")  # blocks the loop: the batch cannot start meanwhile
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert lm.stats()["num_batches"] == batches_before + 1
    for (prompt, name), result in zip(calls, results):
        if name == "a":
            assert isinstance(result, InvalidRequestError) and "'a'" in str(result), repr(result)
        else:
            assert isinstance(result, torch.Tensor), f"{name!r} request failed: {result!r}"
            reference = reference_base if name is None else merged_model(name)
            assert_close(result, reference_logprobs(reference, prompt))
