"""Steady held steps (``internals.install_steady_steps``): lockstep steps of held sessions
that skip vLLM's general scheduling and outputs.

Every row is compared with a plain transformers forward pass of the whole context (as in
``test_vllm_sessions.py``: fp32 kernels differ by rounding only, <= 1e-4), so a steady step
that gave a session the wrong position, the wrong KV block or the wrong token fails. The
counts say which path each step took: a vLLM that moved what the steady path relies on
turns it off, and the tests that expect steady steps fail.
"""

from __future__ import annotations

import asyncio
import importlib.util
import types

import pytest
import torch
from vllm_fixtures import MAX_MODEL_LEN, assert_matches, prompts_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


def counts(vlm):
    """Engine steps so far that took the steady path, and those that took vLLM's."""
    engine = vlm.stats()["engine"]
    steady = engine["num_steady_steps"]
    return steady, engine["num_steps"] - steady


async def run(vlm, hf_reference, contexts, num_steps, change=None):
    """Lockstep: every context takes a token drawn from its row (seeded); each row is checked
    against the reference. ``change(step, contexts)`` may replace the contexts after a step."""
    generator = torch.Generator().manual_seed(len(contexts) + num_steps)
    for step in range(num_steps):
        rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
        for context, row in zip(contexts, rows):
            assert_matches(row, hf_reference("base", context))
        tokens = [int(torch.multinomial(r.exp(), 1, generator=generator)) for r in rows]
        contexts = [c + [t] for c, t in zip(contexts, tokens)]
        if change is not None:
            contexts = change(step, contexts)
    return contexts


def lengths_at_a_block_edge(vlm, num):
    """Prompt lengths that reach and cross a KV block's end within a few steps."""
    block_size = vlm.engine._steady.block_size
    return [block_size - 3 + i for i in range(num)]


async def test_lockstep_steps_after_the_first_three_are_steady_and_exact(vlm, hf_reference):
    assert vlm.engine._steady is not None, "the steady path is off: what it relies on moved in vLLM"
    contexts = prompts_of(lengths_at_a_block_edge(vlm, 5), seed=41)
    before = counts(vlm)
    await run(vlm, hf_reference, contexts, 8)
    steady, general = (a - b for a, b in zip(counts(vlm), before))
    # Step 1 computes the prompts' rows, step 2 opens a session for each extended context,
    # step 3 is their first decode step (vLLM's: the template); steps 4-8 are steady.
    assert steady >= 5, (steady, general)


async def test_sessions_that_park_fork_and_resume_between_steady_steps_stay_exact(
    vlm, hf_reference
):
    # Every third step the particles resample: some contexts are dropped (their sessions
    # park), others duplicated (new sessions from a shared context); a dropped one comes back.
    dropped = []

    def resample(step, contexts):
        if step % 3 != 2:
            return contexts
        dropped.append(contexts[-1])
        survivors = [contexts[0], contexts[0], *contexts[1:-1]]
        if len(dropped) > 1:
            survivors[-1] = dropped[0] + [7]  # a parked session's context, extended
        return survivors

    contexts = prompts_of(lengths_at_a_block_edge(vlm, 5), seed=42)
    before = counts(vlm)
    await run(vlm, hf_reference, contexts, 10, change=resample)
    steady, general = (a - b for a, b in zip(counts(vlm), before))
    assert steady >= 2 and general >= 4, (steady, general)


async def test_sessions_that_reach_the_model_length_stop_through_vllm(vlm, hf_reference):
    # The longest context the model takes is MAX_MODEL_LEN - 1 ids; sessions grow to it in
    # steady steps and the last step stops them (vLLM's stop check, through its update).
    contexts = prompts_of([MAX_MODEL_LEN - 7, MAX_MODEL_LEN - 6], seed=43)
    before = counts(vlm)
    final = await run(vlm, hf_reference, contexts, 6)
    assert max(len(c) for c in final) == MAX_MODEL_LEN
    steady, general = (a - b for a, b in zip(counts(vlm), before))
    assert steady >= 3 and general >= 2, (steady, general)
    row = await vlm.next_token_logprobs(final[0][:-1])  # the engine still serves
    assert_matches(row, hf_reference("base", final[0][:-1]))


async def test_a_plain_request_beside_held_sessions_takes_vllms_steps(vlm, hf_reference):
    contexts = prompts_of([20, 30, 40], seed=44)
    contexts = await run(vlm, hf_reference, contexts, 3)
    before = counts(vlm)
    # A sampling request runs beside the held sessions for a few steps.
    samples, _ = await asyncio.gather(
        vlm.batch_sample(
            [prompts_of([12], seed=45)[0]], max_tokens=4, eos_token_ids=[], temperature=1.0, seed=3
        ),
        run(vlm, hf_reference, contexts, 4),
    )
    assert len(samples[0]) == 4
    steady, general = (a - b for a, b in zip(counts(vlm), before))
    assert general >= 1, (steady, general)


def test_engines_the_steady_path_was_not_checked_on_keep_vllms_steps():
    from genlm_backend.llm.vllm.internals.steady import install_steady_steps

    def engine_with(scheduler):
        core = types.SimpleNamespace(scheduler=scheduler)
        return types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=core))

    class FullAttentionSpec:
        block_size = 16

    class SlidingWindowSpec:
        block_size = 16

    def scheduler(spec, **config):
        class Scheduler:  # the name vLLM's plain scheduler has
            pass

        made = Scheduler()
        made.kv_cache_config = types.SimpleNamespace(
            kv_cache_groups=[types.SimpleNamespace(kv_cache_spec=spec())]
        )
        made.scheduler_config = types.SimpleNamespace(
            async_scheduling=config.get("async_scheduling", False)
        )
        made.log_stats = config.get("log_stats", False)
        for name in (
            "running",
            "requests",
            "waiting",
            "finished_req_ids",
            "reset_preempted_req_ids",
            "current_step",
            "max_model_len",
            "max_num_scheduled_tokens",
            "num_waiting_for_streaming_input",
            "_update_after_schedule",
        ):
            setattr(made, name, None)
        made.kv_cache_manager = types.SimpleNamespace()
        made.schedule = made.update_from_output = lambda *a: None
        return made

    assert install_steady_steps(engine_with(scheduler(FullAttentionSpec))) is not None
    assert install_steady_steps(engine_with(scheduler(SlidingWindowSpec))) is None
    assert (
        install_steady_steps(engine_with(scheduler(FullAttentionSpec, async_scheduling=True)))
        is None
    )
    assert install_steady_steps(engine_with(scheduler(FullAttentionSpec, log_stats=True))) is None
    assert install_steady_steps(types.SimpleNamespace(engine_core=None)) is None
