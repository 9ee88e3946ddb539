"""Two AsyncVirtualLMs in one process, stepped at the same time by one asyncio program.

vLLM keeps the state of the step it runs in process-wide globals (its forward context):
two in-process engines whose threads step at once corrupt each other ("Forward context is
not set", a glibc malloc abort, a hang, or wrong rows). Each engine's rows must be those it
gives alone, while the other engine is built, steps, samples, warms up and shuts down. On the
CPU rows of one context are identical in any batch (``assert_same_rows``), and seeded samples
are the same.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from vllm_fixtures import GPU_ENGINE_OPTS, ON_GPU, assert_same_rows, build_tiny_llama, prompts_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

NUM_STEPS = 8
# More particles than the second engine runs sequences in a step (4).
PARTICLE_LENGTHS = [5, 40, 9, 70, 12, 30]
SECOND_ENGINE_OPTS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4, "seed": 0,
                      **GPU_ENGINE_OPTS}
TIMEOUT_S = 300


async def program(lm, seed):
    """Particles that each take their greedy token for NUM_STEPS steps, alongside seeded
    samples; returns every row of every particle, and the samples."""
    contexts = prompts_of(PARTICLE_LENGTHS, seed=seed)
    rows = [[] for _ in contexts]

    async def particle(i):
        for _ in range(NUM_STEPS):
            row = await lm.next_token_logprobs(contexts[i])
            rows[i].append(row)
            contexts[i] = contexts[i] + [int(row.argmax())]

    samples = lm.batch_sample(prompts_of([4, 6], seed=seed + 100), 5, [], temperature=1.0,
                              seed=seed)
    *_, sampled = await asyncio.gather(*(particle(i) for i in range(len(contexts))), samples)
    return rows, sampled


def assert_same_run(run, alone):
    rows, sampled = run
    assert len(rows) == len(alone[0])
    for particle, particle_alone in zip(rows, alone[0]):
        assert len(particle) == len(particle_alone) == NUM_STEPS
        for row, row_alone in zip(particle, particle_alone):
            assert_same_rows(row, row_alone)
    if not ON_GPU:  # on CUDA the batch's shape moves the logits by rounding, and so samples
        assert sampled == alone[1]


async def until_done(lm, seed, alone, other):
    """Runs the program on ``lm`` again and again until ``other`` is done (at least once)."""
    runs = 0
    while runs == 0 or not other.done():
        assert_same_run(await program(lm, seed), alone)
        runs += 1
        await asyncio.sleep(0)
    return await other


async def test_two_engines_stepped_together_give_the_rows_each_gives_alone(vlm, tmp_path_factory):
    from genlm_backend.llm.vllm import AsyncVirtualLM

    folder = build_tiny_llama(tmp_path_factory.mktemp("second_engine") / "model", seed=1)
    alone_first = await program(vlm, seed=1)
    # Built while the first engine steps: the build runs the model too.
    build = asyncio.ensure_future(asyncio.to_thread(
        AsyncVirtualLM.from_name, str(folder), engine_opts=dict(SECOND_ENGINE_OPTS)))
    try:
        second = await asyncio.wait_for(until_done(vlm, 1, alone_first, build), TIMEOUT_S)
    finally:
        if not build.done():
            build.cancel()
    try:
        alone_second = await program(second, seed=2)
        for _ in range(3):
            first_run, second_run, _ = await asyncio.wait_for(
                asyncio.gather(program(vlm, 1), program(second, 2),
                               asyncio.to_thread(second.warm_up, prompts_of([50, 20], seed=7))),
                TIMEOUT_S,
            )
            assert_same_run(first_run, alone_first)
            assert_same_run(second_run, alone_second)
        # Shut down while the first engine steps.
        closing = asyncio.ensure_future(asyncio.to_thread(second.cleanup))
        await asyncio.wait_for(until_done(vlm, 1, alone_first, closing), TIMEOUT_S)
    finally:
        second.cleanup()
    assert_same_run(await program(vlm, 1), alone_first)
