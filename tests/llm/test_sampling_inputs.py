"""What ``sample``, ``batch_sample`` and ``warm_up`` take, on every backend.

Seeds: an int in ``[0, 2**63 - 1]`` (``batch_sample``'s ``seed + i`` too). A seed outside
fails its own caller with ``InvalidRequestError`` before anything is queued; samples sent
beside it get what they get alone (the reference: the same call, alone).

Token ids: wherever a call takes them (prompts, ``eos_token_ids``, ``warm_up``'s prefixes) it
takes every form ``next_token_logprobs`` takes: lists, tuples, 1-D integer tensors and numpy
arrays, numpy integers; ``eos_token_ids`` also one id. The reference for a stop id is the
sample without it, cut before the first occurrence of that id.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from backends import backend  # noqa: F401 - the fixture
from vllm_fixtures import ROW_ATOL

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError

MAX_SEED = 2**63 - 1
PROMPT = [5, 6, 7, 8]
OTHER = [9, 10, 11]
ARGS = {"max_tokens": 4, "eos_token_ids": [], "temperature": 1.0}


@pytest.mark.parametrize("bad", [2**64, MAX_SEED + 1, -1, -(2**63) - 1])
async def test_an_out_of_range_seed_fails_its_caller_only(backend, bad):
    lm = backend.lm
    alone = [await lm.sample(PROMPT, seed=1, **ARGS), await lm.sample(OTHER, seed=2, **ARGS)]
    results = await asyncio.gather(
        lm.sample(PROMPT, seed=1, **ARGS),
        lm.sample(PROMPT, seed=bad, **ARGS),
        lm.sample(OTHER, seed=2, **ARGS),
        return_exceptions=True,
    )
    assert isinstance(results[1], InvalidRequestError) and f"seed {bad}" in str(results[1])
    assert [results[0], results[2]] == alone


async def test_the_seed_range_and_batch_sample_seeds(backend):
    lm = backend.lm
    top = await lm.sample(OTHER, seed=MAX_SEED, **ARGS)
    assert len(top) == 4
    same = await lm.sample(OTHER, seed=3, **ARGS)
    assert await lm.sample(OTHER, seed=np.int64(3), **ARGS) == same
    assert await lm.batch_sample([PROMPT, OTHER], seed=MAX_SEED - 1, **ARGS) == [
        await lm.sample(PROMPT, seed=MAX_SEED - 1, **ARGS), top]
    with pytest.raises(InvalidRequestError, match="one per prompt"):
        await lm.batch_sample([PROMPT, OTHER], seed=MAX_SEED, **ARGS)
    with pytest.raises(InvalidRequestError):
        await lm.batch_sample([PROMPT, OTHER], seed=2**64 - 1, **ARGS)
    with pytest.raises(InvalidRequestTypeError):
        await lm.sample(PROMPT, seed=1.5, **ARGS)


def forms_of_one_id(token: int) -> list:
    return [token, np.int64(token), np.int32(token), torch.tensor(token), np.array(token), [token],
            (token,), {token}, np.array([token]), torch.tensor([token]), [np.int64(token)]]


def forms_of_a_prompt(prompt: list[int]) -> list:
    return [prompt, tuple(prompt), torch.tensor(prompt), np.array(prompt),
            np.array(prompt, dtype=np.int32), [np.int64(t) for t in prompt]]


async def test_every_form_of_token_ids_in_sampling_calls(backend):
    lm = backend.lm
    args = {"max_tokens": 8, "temperature": 1.0, "seed": 4}
    free = await lm.sample(PROMPT, eos_token_ids=[], **args)
    stop = free[2]
    expected = free[: free.index(stop)]
    for prompt in forms_of_a_prompt(PROMPT):
        assert await lm.sample(prompt, eos_token_ids=[], **args) == free
        backend.check(await lm.next_token_logprobs(prompt), PROMPT)
    for eos in forms_of_one_id(stop):
        assert await lm.sample(PROMPT, eos_token_ids=eos, **args) == expected, repr(eos)
    assert await lm.sample(PROMPT, eos_token_ids=None, **args) == free
    batch = torch.tensor([PROMPT, PROMPT])
    assert await lm.batch_sample(batch, eos_token_ids=np.int64(stop), **args) == [
        expected, await lm.sample(PROMPT, eos_token_ids=[stop], **{**args, "seed": 5})]
    for bad in (1.5, "3", [1.5], torch.tensor([1.5]), True):
        with pytest.raises(InvalidRequestTypeError):
            await lm.sample(PROMPT, eos_token_ids=bad, **args)
    with pytest.raises(InvalidRequestError):
        await lm.sample(PROMPT, eos_token_ids=np.int64(10**7), **args)


@pytest.mark.vllm
async def test_warm_up_takes_every_form_of_prompts(vlm, hf_reference):
    prompt = [5, 6, 7]
    for prefixes in (*forms_of_a_prompt(prompt), [torch.tensor(prompt)], [np.array(prompt), (5, 6)],
                     torch.tensor([prompt, prompt]), np.array([prompt]), range(5, 8)):
        vlm.warm_up(prefixes)
    row = await vlm.next_token_logprobs(prompt)
    assert (row.cpu() - hf_reference("base", prompt)).abs().max().item() <= ROW_ATOL
    with pytest.raises(InvalidRequestTypeError):
        vlm.warm_up(torch.tensor([1.5, 2.0]))
    with pytest.raises(InvalidRequestError):
        vlm.warm_up([])
    with pytest.raises(InvalidRequestError):
        vlm.warm_up(np.array([10**7]))
