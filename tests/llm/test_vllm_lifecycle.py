"""AsyncVirtualLM lifecycle: two engines in one process, cleanup, context managers."""

from __future__ import annotations

import importlib.util

import pytest
from vllm_fixtures import GPU_ENGINE_OPTS, assert_matches

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


async def test_cleanup_of_one_engine_leaves_another_working(vllm_lm, tiny_model_dirs, hf_reference):
    from genlm_backend.llm.vllm import AsyncVirtualLM

    prompt = [5, 900, 31000]
    second = AsyncVirtualLM.from_name(
        str(tiny_model_dirs["base"]),
        engine_opts={"dtype": "float32", "max_model_len": 128, "seed": 0, **GPU_ENGINE_OPTS},
    )
    async with second as entered:
        assert entered is second
        row = await second.next_token_logprobs(prompt)
        assert_matches(row, hf_reference("base", prompt))
    assert second.is_closed
    second.cleanup()  # idempotent
    with pytest.raises(RuntimeError, match="cleaned up"):
        await second.next_token_logprobs(prompt)
    with pytest.raises(RuntimeError):
        await second.sample(prompt, 2, [])
    with pytest.raises(RuntimeError):
        second.warm_up(prompt)
    # the shared engine in this process is untouched
    assert_matches(await vllm_lm.next_token_logprobs(prompt), hf_reference("base", prompt))
    assert len(await vllm_lm.sample(prompt, 3, [], seed=0)) == 3


def test_sync_context_manager_cleans_up(vllm_lm):
    from genlm_backend.llm.vllm import AsyncVirtualLM

    # A wrapper around a live engine, closed by the context manager; its engine is not
    # shut down here because it is the shared one: only test the wrapper's own state.
    class NoShutdown(AsyncVirtualLM):
        def _close(self):
            self._engine_thread.submit(self._sessions.close_all).result()
            self._sample_batcher.close()
            self._sink.close()

    with NoShutdown(vllm_lm.underlying_model) as lm:
        assert lm.next_token_logprobs_sync([3, 4]).shape == (32000,)
    assert lm.is_closed
    with pytest.raises(RuntimeError):
        lm.next_token_logprobs_sync([3, 4])


@pytest.mark.slow
async def test_speculative_decoding_samples_and_lists_exact_rows(vllm_lm, tiny_model_dirs, hf_reference):
    """``speculative_config`` reaches vLLM (the tiny model drafts for itself: no other weights
    needed). Greedy sampling with drafts gives the tokens the same weights give without them
    (the shared engine is the reference). vLLM refuses the capture processor alongside
    drafts, so rows come from vLLM's list of every token's log-probability: each equals the
    transformers forward pass; an out-of-vocabulary id fails its own caller only."""
    import asyncio

    from vllm_fixtures import prompts_of

    from genlm_backend.exceptions import InvalidRequestError
    from genlm_backend.llm.vllm import AsyncVirtualLM

    base = str(tiny_model_dirs["base"])
    prompts = [[5, 900, 31000, 5, 900, 31000, 5], *prompts_of([1, 40, 90], seed=3)]
    opts = {"dtype": "float32", "max_model_len": 128, "seed": 0, **GPU_ENGINE_OPTS,
            "speculative_config": {"method": "draft_model", "model": base, "num_speculative_tokens": 2}}
    lm = AsyncVirtualLM.from_name(base, engine_opts=opts)
    try:
        assert lm.underlying_model.llm_engine.vllm_config.speculative_config is not None
        reference = await vllm_lm.sample(prompts[0], 12, [], temperature=0.0)
        assert await lm.sample(prompts[0], 12, [], temperature=0.0) == reference
        *rows, bad, short = await asyncio.gather(
            *(lm.next_token_logprobs(p) for p in prompts), lm.next_token_logprobs([5, 32000]),
            lm.sample(prompts[0], 3, [], temperature=0.0), return_exceptions=True)
        assert isinstance(bad, InvalidRequestError) and "32000" in str(bad)
        assert short == reference[:3]
        for prompt, row in zip(prompts, rows):
            assert row.device.type == "cpu"
            assert_matches(row, hf_reference("base", prompt))
        # A batch of its own (and again: nothing of the first batch is left behind).
        again = await lm.batch_next_token_logprobs(prompts[1:3])
        for prompt, row in zip(prompts[1:3], again):
            assert_matches(row, hf_reference("base", prompt))
    finally:
        lm.cleanup()


def test_listing_refusal_names_max_logprobs():
    from genlm_backend.llm.vllm import listing_refusal

    assert listing_refusal(-1, 32000) is None
    assert listing_refusal(32000, 32000) is None
    message = listing_refusal(20, 32000)
    assert "max_logprobs=20" in message and "max_logprobs=-1" in message
