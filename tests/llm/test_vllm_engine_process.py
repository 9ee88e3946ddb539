"""A vLLM engine in a process of its own (start_engine_process), on the tiny model: rows
against a plain transformers forward pass, sessions across the process boundary, cleanup
while a step is held."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch
from test_engine_process import alive, engine_children
from vllm_fixtures import ENGINE_OPTS, ON_GPU, assert_matches, prompts_of

from genlm_backend.exceptions import ClosedError

pytest.importorskip("vllm")

# Room for every particle of the test as a session (max_num_seqs 16).
OPTS = {**{k: v for k, v in ENGINE_OPTS.items() if "lora" not in k}, "max_num_seqs": 16}


@pytest.fixture(scope="module")
def process_lm(tiny_model_dirs):
    from genlm_backend.llm.vllm import start_engine_process

    lm = start_engine_process(str(tiny_model_dirs["base"]), engine_opts=dict(OPTS))
    yield lm
    lm.cleanup()


def test_rows_from_the_engine_process_match_a_plain_forward_pass(process_lm, hf_reference):
    """Particles of distinct prompt lengths (chunked prefill: more than max_num_seqs, longer
    than a step's token budget) go on for several steps, with resampling; every row against
    transformers in fp32."""
    rng = random.Random(3)
    contexts = prompts_of([5, 9, 300, 17, 33, 64, 12, 8, 40, 3], seed=4)

    async def run():
        nonlocal contexts
        for step in range(5):
            rows = await asyncio.gather(*[process_lm.next_token_logprobs(c) for c in contexts])
            for context, row in zip(contexts, rows):
                assert row.device.type == ("cuda" if ON_GPU else "cpu")
                assert_matches(row, hf_reference("base", context))
            contexts = [c + [int(torch.multinomial(r.exp(), 1))] for c, r in zip(contexts, rows)]
            if step == 2:
                contexts = [list(rng.choice(contexts)) for _ in contexts]

    asyncio.run(run())
    stats = process_lm.stats()
    # Particles went on as engine sessions in the child: held steps continued by the next
    # batch (the two steps before the resampling and the two after it).
    assert stats["sessions"]["num_continued"] >= 2 * len(contexts)
    assert stats["engine_process"] == {"pid": process_lm.engine.pid, "running": True}
    assert process_lm.vocab_size == 32000 and process_lm.max_prompt_len == OPTS["max_model_len"] - 1


def test_cleanup_while_a_session_step_is_held_stops_the_engine_process(
        tiny_model_dirs, fresh_tmp):
    from genlm_backend.llm.vllm import start_engine_process

    before = set(engine_children())
    lm = start_engine_process(str(tiny_model_dirs["base"]), engine_opts=dict(OPTS),
                              session_hold_s=30.0)
    pid = lm.engine.pid

    async def run():
        contexts = prompts_of([6, 7], seed=5)
        await asyncio.gather(*[lm.next_token_logprobs(c) for c in contexts])
        # The engine now holds the step for the next batch (30 s); a request not yet sent
        # and one in flight both end with the cleanup.
        waiting = asyncio.ensure_future(lm.next_token_logprobs(contexts[0] + [3]))
        await asyncio.sleep(0)
        started = time.monotonic()
        lm.cleanup()
        assert time.monotonic() - started < 20.0
        with pytest.raises(ClosedError):
            await waiting

    asyncio.run(run())
    assert not alive(pid)
    assert set(engine_children()) <= before
    assert list(fresh_tmp.iterdir()) == []
