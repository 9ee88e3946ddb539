"""LoRA adapters on AsyncVirtualLM: batches that mix adapters and the base model.

Every row is compared with a plain transformers forward pass of the weights it stands for:
the base model for requests without an adapter, the merged model (base + adapter folded
into the weights) for adapter requests. Tolerance ``ROW_ATOL`` (1e-4 on CPU, measured about
1e-5): vLLM runs the adapter as a separate low-rank product and its own CPU kernels, which
round differently from the merged fp32 reference. A row computed with another request's
adapter differs by far more (measured 24-29 here; 4.1-4.6 in the issue's report).

The engine holds ``max_loras=2`` adapter slots and both adapters are loaded: vLLM's CPU
LoRA ops (0.32) gave base-model tokens the adapter of the last slot in every step that also
ran adapter tokens (see ``internals.install_lora_base_rows``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading

import pytest
import torch
import vllm_fixtures
from vllm_fixtures import ROW_ATOL, cpu_lora, prompts_of

# This module's fixtures (the shared ones come from conftest).
second_adapter_dirs = vllm_fixtures.second_adapter_dirs
lora_reference = vllm_fixtures.lora_reference

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
    cpu_lora,
]


def assert_rows_match(calls, rows, reference) -> None:
    """Each row within ``ROW_ATOL`` of its reference; names every row that is not."""
    diffs = [
        (row.cpu() - reference(name, prompt)).abs().max().item()
        for (prompt, name), row in zip(calls, rows)
    ]
    wrong = [(i, calls[i][1], round(d, 4)) for i, d in enumerate(diffs) if not d <= ROW_ATOL]
    assert not wrong, f"rows (index, adapter, max abs diff) off their references: {wrong}"


@pytest.fixture
def lora_vlm(vlm, tiny_model_dirs, second_adapter_dirs):
    """The shared model with adapters ``a`` and ``b`` registered."""
    vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "a")
    vlm.add_new_lora(str(second_adapter_dirs["adapter"]), "b")
    return vlm


P, Q, R = prompts_of([13, 6, 21], seed=70)
MIXES = {
    # The batch (its base rows were off by 4.1 and 4.6 there).
    "none+a+b": [(P, None), (P, "a"), (P, "b"), (Q, "a"), (Q, None)],
    "a+none": [(P, "a"), (P, None)],
    "none+a": [(Q, None), (Q, "a")],
    "b+a+none": [(R, "b"), (Q, "a"), (P, None)],
    # The same prompt under every adapter, twice (identical requests are evaluated once).
    "repeated": [(R, None), (R, "a"), (R, "b"), (R, None), (R, "a"), (R, "b"), (P, "b"), (P, None)],
}


@pytest.mark.parametrize("sessions", [True, False], ids=["sessions", "no-sessions"])
@pytest.mark.parametrize("mix", list(MIXES))
async def test_mixed_batches_match_their_references(lora_vlm, lora_reference, sessions, mix):
    lora_vlm.set_sessions(sessions)
    calls = MIXES[mix]
    batches_before = lora_vlm.stats()["num_batches"]
    rows = await asyncio.gather(
        *(lora_vlm.next_token_logprobs(p, lora_name=name) for p, name in calls)
    )
    assert lora_vlm.stats()["num_batches"] == batches_before + 1
    assert_rows_match(calls, rows, lora_reference)


@pytest.mark.parametrize("sessions", [True, False], ids=["sessions", "no-sessions"])
async def test_mixed_lockstep_steps_match_their_references(lora_vlm, lora_reference, sessions):
    """Contexts under different adapters extended token by token in one batch a step (with
    sessions on, the later steps continue held sessions of every adapter at once)."""
    lora_vlm.set_sessions(sessions)
    names = [None, "a", "b", None, "a"]
    contexts = [list(c) for c in prompts_of([5, 5, 9, 12, 7], seed=71)]
    for _ in range(4):
        rows = await asyncio.gather(
            *(lora_vlm.next_token_logprobs(c, lora_name=n) for c, n in zip(contexts, names))
        )
        assert_rows_match(list(zip(contexts, names)), rows, lora_reference)
        contexts = [c + [int(row.argmax())] for c, row in zip(contexts, rows)]
    if sessions:  # the later steps continued held sessions of every adapter
        assert lora_vlm.stats()["sessions"]["num_continued"] >= 3 * len(names)


# ---- removing an adapter while its requests are in flight ---------------------------------

REMOVAL_MIX = [(P, None), (P, "a"), (Q, "b"), (Q, "a"), (R, None), (R, "b")]


def assert_removal_outcome(calls, results, reference, may_succeed: bool) -> None:
    """Requests of other adapters (and the base model) get exact rows; those of the removed
    adapter ``a`` get an error naming it (or, with ``may_succeed``, their exact row)."""
    for (prompt, name), result in zip(calls, results):
        if name == "a" and not (may_succeed and isinstance(result, torch.Tensor)):
            assert isinstance(result, ValueError) and "'a'" in str(result), repr(result)
        else:
            assert isinstance(result, torch.Tensor), f"{name!r} request failed: {result!r}"
            assert_rows_match([(prompt, name)], [result], reference)


@pytest.mark.parametrize("sessions", [True, False], ids=["sessions", "no-sessions"])
async def test_removing_an_adapter_fails_only_its_queued_requests(
    lora_vlm, lora_reference, sessions
):
    """The adapter goes between the requests' submission (validated, queued) and their
    batch's evaluation."""
    lora_vlm.set_sessions(sessions)
    await lora_vlm.next_token_logprobs(P, lora_name="a")  # a live session of ``a`` (sessions on)
    batches_before = lora_vlm.stats()["num_batches"]
    tasks = [
        asyncio.ensure_future(lora_vlm.next_token_logprobs(p, lora_name=n)) for p, n in REMOVAL_MIX
    ]
    await asyncio.sleep(0)  # every request is validated and queued; the batch starts after this
    lora_vlm.remove_lora("a")  # blocks the loop: the batch cannot start meanwhile
    assert lora_vlm.stats()["num_batches"] == batches_before
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert lora_vlm.stats()["num_batches"] == batches_before + 1
    assert_removal_outcome(REMOVAL_MIX, results, lora_reference, may_succeed=False)
    assert {s.lora_name for s in lora_vlm.engine._sessions._sessions.values()} <= {None, "b"}
    assert lora_vlm.hash_to_int("a") not in lora_vlm.llm.llm_engine.list_loras()


@pytest.mark.parametrize("sessions", [True, False], ids=["sessions", "no-sessions"])
async def test_removing_an_adapter_while_its_batch_waits_for_the_engine(
    lora_vlm, lora_reference, sessions
):
    """The batch is on the engine thread's queue (behind other engine work) when the adapter
    is removed: its requests of ``a`` run before the removal or fail with a clear error; the
    others are exact either way, and the adapter is gone from the engine afterwards."""
    lora_vlm.set_sessions(sessions)
    started, go = threading.Event(), threading.Event()
    blocker = lora_vlm.engine.thread.submit(lambda: (started.set(), go.wait(60)))
    assert started.wait(60)
    try:
        batches_before = lora_vlm.stats()["num_batches"]
        tasks = [
            asyncio.ensure_future(lora_vlm.next_token_logprobs(p, lora_name=n))
            for p, n in REMOVAL_MIX
        ]
        while lora_vlm.stats()["num_batches"] == batches_before:  # handed to the engine thread
            await asyncio.sleep(0.001)
        removal = threading.Thread(target=lora_vlm.remove_lora, args=("a",))
        removal.start()
        while len(lora_vlm.engine.thread._queue) < 2:  # the removal waits behind the batch
            removal.join(0.001)
    finally:
        go.set()
    blocker.result(60)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.to_thread(removal.join, 60)
    assert_removal_outcome(REMOVAL_MIX, results, lora_reference, may_succeed=True)
    assert "a" not in lora_vlm._lora_paths
    assert lora_vlm.hash_to_int("a") not in lora_vlm.llm.llm_engine.list_loras()


async def test_a_sample_queued_behind_the_removal_of_its_adapter_fails(lora_vlm):
    """A sampling job carries its adapter from the call on; once the adapter is removed the
    engine must not load it again from its folder for that job (a later adapter of the same
    name would then run the old weights under the same id)."""
    started, go = threading.Event(), threading.Event()
    blocker = lora_vlm.engine.thread.submit(lambda: (started.set(), go.wait(60)))
    assert started.wait(60)
    try:
        sample = asyncio.ensure_future(lora_vlm.sample(P, 3, [], seed=0, lora_name="a"))
        base = asyncio.ensure_future(lora_vlm.sample(P, 3, [], seed=0))
        # the jobs are made (with their adapters); their batch is not sent yet
        await asyncio.sleep(0)
        removal = threading.Thread(target=lora_vlm.remove_lora, args=("a",))
        removal.start()
        while not lora_vlm.engine.thread._queue:  # the removal waits for the engine thread first
            removal.join(0.001)
    finally:
        go.set()
    blocker.result(60)
    results = await asyncio.gather(sample, base, return_exceptions=True)
    await asyncio.to_thread(removal.join, 60)
    assert isinstance(results[0], ValueError) and "'a'" in str(results[0]), repr(results[0])
    assert isinstance(results[1], list) and len(results[1]) == 3
    assert lora_vlm.hash_to_int("a") not in lora_vlm.llm.llm_engine.list_loras()
