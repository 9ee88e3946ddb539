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
