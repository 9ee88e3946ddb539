"""Engine sessions of AsyncVirtualLM: lockstep requests that extend live engine requests.

Every row is compared with a plain transformers forward pass of the whole context (same
tolerance as ``test_vllm.py``: fp32 kernels differ by rounding only, <= 1e-4), so a session
that appended a token to the wrong context, or a row that went to the wrong caller, fails.
The shared engine has ``max_num_seqs=8``: at most 8 live sessions.
"""

from __future__ import annotations

import asyncio
import importlib.util
import warnings

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

from genlm_backend.exceptions import EngineError, InvalidRequestError
from genlm_backend.llm.prompts import LogprobsRequest
from genlm_backend.llm.vllm.session_pool import SessionStatus

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]



async def lockstep(vlm, contexts, num_steps, lora_name=None):
    """Every context takes its greedy token each step; returns the contexts and their rows."""
    rows = []
    for _ in range(num_steps):
        rows = await asyncio.gather(
            *(vlm.next_token_logprobs(c, lora_name=lora_name) for c in contexts)
        )
        contexts = [c + [int(r.argmax())] for c, r in zip(contexts, rows)]
    return [c[:-1] for c in contexts], rows


def sessions(vlm):
    return vlm.stats()["sessions"]


def park_sessions(vlm):
    """Any other engine work ends a hold: the held sessions park."""
    vlm.engine.thread.submit(lambda: None).result()


async def test_rows_through_sessions_equal_a_forward_pass(vlm, hf_reference):
    contexts = prompts_of([3, 9, 17, 40], seed=30)
    extended = sessions(vlm)["num_extended"]
    for _ in range(4):
        rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
        for context, row in zip(contexts, rows):
            assert_matches(row, hf_reference("base", context))
        contexts = [c + [int(torch.multinomial(r.exp(), 1))] for c, r in zip(contexts, rows)]
    assert sessions(vlm)["num_extended"] - extended == 12  # steps 2-4 extend all four
    assert sessions(vlm)["num_live"] == 4


async def test_lockstep_steps_continue_held_sessions_without_re_adding_them(vlm, hf_reference):
    # Each step's rows go out inside the engine step; the next batch's plan runs while that
    # step waits, and forces every particle's token: no chunk is added after the first.
    contexts = prompts_of([4, 11, 23], seed=42)
    before = sessions(vlm)
    engine = vlm.stats()["engine"]
    final, rows = await lockstep(vlm, contexts, 5)
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))
    after = sessions(vlm)
    assert after["num_opened"] - before["num_opened"] == 3
    assert after["num_continued"] - before["num_continued"] == 12
    # one engine step per lockstep step
    assert vlm.stats()["engine"]["num_steps"] - engine["num_steps"] == 5
    # Steps 2-5 force every row: their tokens are the sample, without vLLM's sampler.
    assert vlm.stats()["engine"]["num_forced_steps"] - engine["num_forced_steps"] == 4


async def test_a_step_mixing_forced_and_parked_rows_forces_through_the_logits(vlm, hf_reference):
    # The tokens of a batch's continuations are forced in the step that computed the last
    # batch's rows. When the next batch continues only some of them, the others are parked
    # in that step: not every row is forced, so the forced ones go through the logits and
    # vLLM samples; the parked one drops its sampled token and resumes later by a chunk.
    a, b, c = prompts_of([7, 12, 9], seed=47)
    engine = vlm.stats()["engine"]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(x) for x in (a, b, c)))
    a, b, c = (x + [int(r.argmax())] for x, r in zip((a, b, c), rows))
    final, rows = await lockstep(vlm, [a, b], 3)  # the first of these steps parks ``c``
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))
    assert_matches(await vlm.next_token_logprobs(c), hf_reference("base", c))
    assert vlm.stats()["engine"]["num_forced_steps"] - engine["num_forced_steps"] == 2


async def test_forced_steps_give_the_rows_of_forcing_through_the_logits(vlm):
    contexts = prompts_of([5, 8, 13], seed=49)
    final_on, rows_on = await lockstep(vlm, contexts, 4)
    vlm.close_sessions()
    from genlm_backend.llm.vllm import capture

    with pytest.MonkeyPatch.context() as patch:  # the processor forces tokens in the logits
        patch.setattr(capture, "current_forcing", lambda: None)
        engine = vlm.stats()["engine"]
        final_off, rows_off = await lockstep(vlm, contexts, 4)
        assert vlm.stats()["engine"]["num_forced_steps"] == engine["num_forced_steps"]
    assert final_on == final_off
    for a, b in zip(rows_on, rows_off):
        assert_same_rows(a, b)


async def test_a_parked_session_resumes_by_a_chunk(vlm, hf_reference):
    contexts = prompts_of([6, 9], seed=43)
    await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
    park_sessions(vlm)
    before = sessions(vlm)
    nxt = [c + [17] for c in contexts]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in nxt))
    for context, row in zip(nxt, rows):
        assert_matches(row, hf_reference("base", context))
    after = sessions(vlm)
    assert after["num_extended"] - before["num_extended"] == 2
    assert after["num_continued"] == before["num_continued"]  # re-added, not continued


async def test_a_resumed_session_is_held_as_long_as_a_new_one(vlm, hf_reference):
    # Parking lowers a session's max_tokens so that it stops after its step; the chunk that
    # resumes it must bring back the held sessions' max_tokens (vLLM 0.26 kept the lowered
    # value: the resumed session stopped by itself a few steps later).
    context = prompts_of([8], seed=53)[0]
    final, rows = await lockstep(vlm, [context], 6)
    park_sessions(vlm)
    before = sessions(vlm)
    final, rows = await lockstep(vlm, [final[0] + [int(rows[0].argmax())]], 12)
    assert_matches(rows[0], hf_reference("base", final[0]))
    after = sessions(vlm)
    assert after["num_continued"] - before["num_continued"] == 11  # resumed once, then held
    assert after["num_opened"] == before["num_opened"]


async def test_parked_sessions_stay_out_of_the_schedulers_walk(vlm, hf_reference, monkeypatch):
    # vLLM's schedule() pops every parked session from its waiting queue, finds it blocked
    # and puts it back, every step (1 ms a step for W5's 220 parked sessions at N=256 on the
    # H200 host). With the bypass it never looks at them, and they still resume where they
    # were.
    from vllm.v1.request import RequestStatus

    from genlm_backend.llm.vllm.internals.engine_core import _scheduler
    from genlm_backend.llm.vllm.internals.installed import installed_on

    scheduler = _scheduler(vlm.llm.llm_engine)
    assert installed_on(scheduler).get("parked_bypass")
    checks = ("_handle_blocked_waiting_request", "_try_promote_blocked_waiting_request")
    name = next((n for n in checks if hasattr(scheduler, n)), None)
    assert name is not None, (
        "vLLM's scheduler has neither blocked-request check this test counts through"
    )
    looked_at = []
    check = getattr(scheduler, name)

    def counted(request, *args, **kwargs):
        if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            looked_at.append(request.request_id)
        return check(request, *args, **kwargs)

    monkeypatch.setattr(scheduler, name, counted)
    vlm.close_sessions()
    parked = prompts_of([5, 9, 14], seed=61)
    await asyncio.gather(*(vlm.next_token_logprobs(c) for c in parked))
    park_sessions(vlm)
    assert scheduler.num_waiting_for_streaming_input == 3
    final, rows = await lockstep(vlm, prompts_of([6, 11], seed=62), 4)
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))
    assert looked_at == []
    assert scheduler.num_waiting_for_streaming_input == 3  # still parked, still counted
    resumed = [c + [23] for c in parked]
    before = sessions(vlm)
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in resumed))
    for context, row in zip(resumed, rows):
        assert_matches(row, hf_reference("base", context))
    assert sessions(vlm)["num_extended"] - before["num_extended"] == 3  # resumed, not reopened
    assert sessions(vlm)["num_opened"] == before["num_opened"]


async def test_resampled_duplicates_share_a_context_and_diverge(vlm, hf_reference):
    parent = prompts_of([12], seed=31)[0]
    await vlm.next_token_logprobs(parent)
    # Resampling: three particles now share `parent`; each appends a different token.
    children = [parent + [t] for t in (101, 202, 303)]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in children))
    for child, row in zip(children, rows):
        assert_matches(row, hf_reference("base", child))
    # One extended the parent's session, two opened new ones; all continue by extension.
    extended = sessions(vlm)["num_extended"]
    grandchildren = [c + [7] for c in children] + [children[0] + [8]]  # a second fork of child 0
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in grandchildren))
    for context, row in zip(grandchildren, rows):
        assert_matches(row, hf_reference("base", context))
    assert sessions(vlm)["num_extended"] - extended == 3


async def test_new_sessions_are_built_on_an_earlier_sessions_request(
    vlm, hf_reference, monkeypatch
):
    """vLLM's input processing (prompt rendering, parameter checks; most of the cost of a
    fork after resampling) runs for a backend's first session of an adapter only: later new
    sessions copy that session's engine request, with their own id and context."""
    engine = vlm.llm.llm_engine
    processed = []
    original = engine.input_processor.process_inputs

    def counted(request_id, *args, **kwargs):
        processed.append(request_id)
        return original(request_id, *args, **kwargs)

    monkeypatch.setattr(engine.input_processor, "process_inputs", counted)
    opened = sessions(vlm)["num_opened"]
    parent = prompts_of([14], seed=44)[0]
    await vlm.next_token_logprobs(parent)
    children = [parent + [t] for t in (11, 22, 33, 44)]  # resampled particles, each its own token
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in children))
    for child, row in zip(children, rows):
        assert_matches(row, hf_reference("base", child))
    grandchildren = [c + [5] for c in children]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in grandchildren))
    for context, row in zip(grandchildren, rows):
        assert_matches(row, hf_reference("base", context))
    assert sessions(vlm)["num_opened"] - opened >= 4  # the parent's and three forks
    assert len(processed) <= 1  # this engine's first session, if no test opened one before
    live = [s.request_id for s in vlm.engine._sessions._sessions.values()]
    assert len(live) == len(set(live))


async def test_sessions_are_bounded_and_evicted_least_recently_used_first(vlm, hf_reference):
    vlm.set_sessions(3)
    contexts = prompts_of([5, 6, 7, 8, 9], seed=32)
    final, rows = await lockstep(vlm, contexts, 3)
    assert sessions(vlm)["num_live"] <= 3
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))
    vlm.set_sessions(True)
    # Sessions not extended for `idle_batches` batches are closed.
    chain = prompts_of([4], seed=33)[0]
    for i in range(vlm.engine._sessions.idle_batches + 1):
        await vlm.next_token_logprobs(chain)
        chain = chain + [i + 3]
    assert sessions(vlm)["num_live"] == 1
    assert vlm.close_sessions() == 1
    assert sessions(vlm)["num_live"] == 0


async def test_as_many_particles_as_engine_slots_all_continue_held_sessions(vlm, hf_reference):
    # max_num_seqs particles, one session each: every step after the first continues all of
    # them (with a slot kept spare, one particle a step ran as a new plain request).
    contexts = prompts_of([5, 6, 7, 8, 9, 10, 11, 12], seed=44)
    before = sessions(vlm)
    vlm.engine._sessions.warned_crowded = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # as many contexts as sessions: no warning
        final, rows = await lockstep(vlm, contexts, 4)
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))
    after = sessions(vlm)
    assert after["num_opened"] - before["num_opened"] == 8
    assert after["num_continued"] - before["num_continued"] == 8 * 3


async def test_moving_every_particle_to_new_contexts_warns_nothing(vlm, hf_reference):
    # 8 particles on 8 slots move to 8 fresh unrelated contexts, then resample (forks): at
    # no time are more than 8 contexts extended at once, so no crowding warning.
    vlm.engine._sessions.warned_crowded = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        await lockstep(vlm, prompts_of([5] * 8, seed=47), 2)
        final, rows = await lockstep(vlm, prompts_of([6] * 8, seed=48), 3)
        resampled = [list(final[i // 2]) for i in range(8)]
        final, rows = await lockstep(vlm, resampled, 3)
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))


async def test_parked_sessions_give_their_slots_to_sampling(vlm):
    prompts = prompts_of([4, 5, 6, 7], seed=45)
    expected = await vlm.batch_sample(prompts, 4, [], seed=3)  # no session holds a slot
    await lockstep(vlm, prompts_of([6] * 8, seed=46), 2)
    park_sessions(vlm)
    assert sessions(vlm)["num_live"] >= 7  # parked sessions hold all slots, or all but one
    steps = vlm.stats()["engine"]["num_steps"]
    samples = await asyncio.wait_for(vlm.batch_sample(prompts, 4, [], seed=3), timeout=120)
    assert samples == expected
    # The four samples share their steps (one at a time, in one free slot, took 16).
    assert vlm.stats()["engine"]["num_steps"] - steps <= 5
    assert sessions(vlm)["num_live"] <= 4  # the least recently used made room


async def test_more_particles_than_engine_slots_still_make_progress(vlm, hf_reference):
    # 12 particles, 8 session slots: the rest run as plain requests; nothing waits forever,
    # and the caller is told, once, to give the engine more slots.
    contexts = prompts_of([6] * 12, seed=34)
    vlm.engine._sessions.warned_crowded = False
    with pytest.warns(RuntimeWarning, match="max_num_seqs") as warned:
        final, rows = await asyncio.wait_for(lockstep(vlm, contexts, 3), timeout=120)
    assert len([w for w in warned if "max_num_seqs" in str(w.message)]) == 1
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))
    assert sessions(vlm)["num_live"] <= 8
    # Sampling still finds a free slot while sessions are parked.
    assert len(await asyncio.wait_for(vlm.sample(contexts[0], 4, [], seed=0), timeout=60)) == 4


async def test_a_failed_batch_closes_its_sessions_and_the_next_one_reopens(
    vlm, hf_reference, monkeypatch
):
    contexts = prompts_of([5, 6], seed=35)
    await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
    nxt = [c + [9] for c in contexts]
    with monkeypatch.context() as patch:
        before_each_attempt(patch, vlm.engine._runner, engine_broke)
        results = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in nxt),
                                       return_exceptions=True)
    assert all(isinstance(r, EngineError) for r in results)
    assert sessions(vlm)["num_live"] == 0
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in nxt))
    for context, row in zip(nxt, rows):
        assert_matches(row, hf_reference("base", context))


async def test_a_refused_chunk_fails_only_its_caller(vlm, hf_reference, monkeypatch):
    from genlm_backend.llm.vllm import internals

    contexts = prompts_of([5, 6, 7], seed=36)
    await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
    park_sessions(vlm)  # extending a parked session adds a chunk, which vLLM may refuse
    doomed = vlm.engine._sessions._by_key[LogprobsRequest(tuple(contexts[1]), None)].request_id
    original = internals.add_session_chunk

    def refuse(engine, request_id, *args):
        if request_id == doomed:
            raise ValueError("refused")
        return original(engine, request_id, *args)

    monkeypatch.setattr(internals, "add_session_chunk", refuse)
    nxt = [c + [11] for c in contexts]
    results = await asyncio.gather(
        *(vlm.next_token_logprobs(c) for c in nxt), return_exceptions=True
    )
    assert isinstance(results[1], InvalidRequestError)
    for i in (0, 2):
        assert_matches(results[i], hf_reference("base", nxt[i]))
    monkeypatch.undo()
    park_sessions(vlm)  # the batch ends (and settles) once its held step is released
    assert doomed not in {s.request_id for s in vlm.engine._sessions._sessions.values()}
    assert_matches(await vlm.next_token_logprobs(nxt[1]), hf_reference("base", nxt[1]))


async def test_a_cancelled_caller_leaves_the_others_and_the_sessions_usable(vlm, hf_reference):
    contexts = prompts_of([5, 6], seed=37)
    await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
    nxt = [c + [13] for c in contexts]
    tasks = [asyncio.ensure_future(vlm.next_token_logprobs(c)) for c in nxt]
    await asyncio.sleep(0)
    tasks[0].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError)
    assert_matches(results[1], hf_reference("base", nxt[1]))
    after = [c + [14] for c in nxt]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in after))
    for context, row in zip(after, rows):
        assert_matches(row, hf_reference("base", context))


@cpu_lora
async def test_sessions_are_kept_apart_per_adapter(vlm, hf_reference, tiny_model_dirs):
    vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "ad")
    context = prompts_of([8], seed=38)[0]
    for step in range(3):
        base, lora = await asyncio.gather(
            vlm.next_token_logprobs(context), vlm.next_token_logprobs(context, "ad")
        )
        assert_matches(base, hf_reference("base", context))
        assert_matches(lora, hf_reference("merged", context))
        context = context + [int(base.argmax())]
    assert sessions(vlm)["num_live"] == 2
    vlm.remove_lora("ad")  # closes the adapter's sessions
    assert {s.lora_name for s in vlm.engine._sessions._sessions.values()} == {None}


def test_close_sessions_lets_the_engine_be_driven_directly(vlm):
    from vllm import SamplingParams, TokensPrompt

    vlm.next_token_logprobs_sync(prompts_of([6], seed=39)[0])
    assert vlm.close_sessions() >= 1
    llm = vlm.llm
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=2), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2


async def test_sessions_off_gives_the_same_rows(vlm, hf_reference):
    vlm.set_sessions(False)
    contexts = prompts_of([5, 9], seed=40)
    final, rows = await lockstep(vlm, contexts, 2)
    assert sessions(vlm)["num_live"] == 0
    for context, row in zip(final, rows):
        assert_matches(row, hf_reference("base", context))


async def test_a_stalled_engine_frees_its_parked_sessions(vlm, hf_reference):
    # A parked request that is not this model's holds the 8th slot: once 7 sessions park,
    # the plain requests of the batch find no slot; the runner must free the parked ones.
    from vllm import SamplingParams

    from genlm_backend.llm.vllm import internals

    engine = vlm.llm.llm_engine

    def park_foreign():
        sink = vlm.engine._sink
        params = SamplingParams(max_tokens=1, extra_args=sink.extra_args(sink.new_tag()))
        internals.add_session_chunk(engine, "foreign-session", [5, 6, 7], params, None)
        while not any(internals.output_done(o) for o in engine.step()):
            pass

    vlm.engine.thread.submit(park_foreign).result()
    try:
        contexts = prompts_of([6] * 12, seed=41)
        final, rows = await asyncio.wait_for(lockstep(vlm, contexts, 2), timeout=120)
        for context, row in zip(final, rows):
            assert_matches(row, hf_reference("base", context))
    finally:
        vlm.engine.thread.submit(internals.abort_requests, engine, ["foreign-session"]).result()


async def test_a_hold_nobody_continues_expires_and_parks_its_sessions(vlm, hf_reference):
    vlm.session_hold_s = 0.05
    try:
        contexts = prompts_of([5, 8], seed=44)
        await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
        # No next batch, no other engine work: the 0.05 s wait times out (well before the
        # default 1 s hold would: the attribute set on the model is the one the engine reads).
        await asyncio.sleep(0.5)
        assert {s.status for s in vlm.engine._sessions._sessions.values()} == {SessionStatus.PARKED}
        nxt = [c + [19] for c in contexts]
        rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in nxt))
        for context, row in zip(nxt, rows):
            assert_matches(row, hf_reference("base", context))
    finally:
        vlm.session_hold_s = 1.0


async def test_out_of_memory_in_a_step_of_continued_sessions_retries_them_as_plain_requests(
    vlm, hf_reference, monkeypatch
):
    # Continuations have no engine request of their own; when the step that should answer
    # them runs out of device memory, their sessions close and they run again as plain
    # requests (in halves), each caller still getting the row of its own context.
    import torch

    contexts = prompts_of([5, 7, 9, 11], seed=45)
    final, _ = await lockstep(vlm, contexts, 2)  # every session is held after this
    engine = vlm.llm.llm_engine
    original, calls = engine.step, []

    def out_of_memory_once():
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original()

    monkeypatch.setattr(engine, "step", out_of_memory_once)
    splits, closed = vlm.stats()["engine"]["num_oom_splits"], sessions(vlm)["num_closed"]
    nxt = [c + [21 + i] for i, c in enumerate(final)]
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in nxt))
    for context, row in zip(nxt, rows):
        assert_matches(row, hf_reference("base", context))
    assert vlm.stats()["engine"]["num_oom_splits"] > splits
    assert sessions(vlm)["num_closed"] - closed == 4
    monkeypatch.undo()
    after = [c + [3] for c in nxt]  # new sessions open and work
    rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in after))
    for context, row in zip(after, rows):
        assert_matches(row, hf_reference("base", context))


async def test_a_continued_session_whose_row_never_comes_fails_only_its_caller(vlm, hf_reference):
    # A held session closed by other work between the plan and its step (here: aborted
    # from the engine thread after the plan continued it) fails its caller with an
    # EngineError instead of leaving it hanging; the other continuations get their rows.
    contexts = prompts_of([5, 8], seed=46)
    final, _ = await lockstep(vlm, contexts, 2)
    pool = vlm.engine._sessions
    original_plan, victims = pool.plan, []

    def plan_then_abort(requests, batch):
        plan = original_plan(requests, batch)
        victim = plan[0]
        victims.append(victim)
        # gone from the engine; the pool still counts on it
        vlm.engine._runner.abort([victim.request_id])
        return plan

    pool.plan = plan_then_abort
    try:
        nxt = [c + [31] for c in final]
        results = await asyncio.wait_for(
            asyncio.gather(*(vlm.next_token_logprobs(c) for c in nxt), return_exceptions=True),
            timeout=120,
        )
    finally:
        del pool.plan
    assert isinstance(results[0], EngineError)
    assert_matches(results[1], hf_reference("base", nxt[1]))
    assert victims and victims[0].status is SessionStatus.CLOSED
    assert_matches(await vlm.next_token_logprobs(nxt[0]), hf_reference("base", nxt[0]))


def test_a_held_session_that_cannot_be_parked_stays_closed():
    """Where parking fails (the engine no longer knows the request), the backend closes the
    session instead; the plan that left it out must not mark it parked again."""
    from types import SimpleNamespace

    from genlm_backend.llm.prompts import PromptChecker
    from genlm_backend.llm.vllm.session_pool import PlanEntry, SessionPool

    aborted = []
    pool = SessionPool(aborted.extend, 4, park=lambda session: pool.close(session),
                       follow=lambda tag, target: None, unfollow=lambda tag: None)
    checker = PromptChecker(100, None)
    first, other = checker.request([1, 2, 3], None), checker.request([7, 8, 9], None)
    (entry,) = pool.plan([first], None)
    assert isinstance(entry, PlanEntry)
    job = SimpleNamespace(result=None, batch=None, stream_request=None, params=None)
    job.finish = lambda row: setattr(job, "result", row)
    pool.bind(entry, job, tag=1)
    pool.deliver(entry.session, torch.zeros(3))
    assert entry.session.status is SessionStatus.HELD
    pool.plan([other], None)  # leaves the held session out: parking it closes it
    assert entry.session.status is SessionStatus.CLOSED and aborted == [entry.session.request_id]
    assert pool.get(entry.session.request_id) is None and first.kept is None


def test_free_parked_closes_the_least_recently_used_parked_sessions_a_batch_does_not_resume():
    from types import SimpleNamespace

    from genlm_backend.llm.vllm.session_pool import Session, SessionPool

    aborted = []
    pool = SessionPool(aborted.extend, 8)
    parked, running = SessionStatus.PARKED, SessionStatus.RUNNING
    sessions = [Session(f"s{i}", None, status=status) for i, status in
                enumerate([parked, running, parked, parked, parked])]
    for session in sessions:  # least recently used first
        pool._sessions[session.request_id] = session
    resumes_s2 = SimpleNamespace(stream_id="s2", is_done=False)
    finished_s3 = SimpleNamespace(stream_id="s3", is_done=True)  # no longer in use
    assert pool.free_parked([resumes_s2, finished_s3], 2)
    assert aborted == ["s0", "s3"]  # s1 runs, s2 is resumed by the batch
    assert pool.free_parked([resumes_s2], None) and aborted == ["s0", "s3", "s4"]
    assert not pool.free_parked([resumes_s2], None)
    assert sorted(pool._sessions) == ["s1", "s2"]


class FakeSteps:
    """A :class:`SessionPool` of ``capacity`` sessions driven without an engine: each batch is
    planned, every chunk and continuation gets its row, and the step's hold is released."""

    def __init__(self, capacity):
        from types import SimpleNamespace

        from genlm_backend.llm.prompts import PromptChecker
        from genlm_backend.llm.vllm.session_pool import PlanEntry, SessionPool

        self.namespace, self.entry_type = SimpleNamespace, PlanEntry
        self.pool = SessionPool(lambda ids: None, capacity, park=lambda session: None,
                                follow=lambda tag, target: None, unfollow=lambda tag: None)
        self.checker = PromptChecker(1000, None)
        self.tags = iter(range(1, 10**6))

    def batch(self, contexts):
        requests = [self.checker.request(c, None) for c in contexts]
        rows = self.namespace(set=lambda i, row: None)
        for entry in self.pool.plan(requests, rows):
            if isinstance(entry, self.entry_type):
                job = self.namespace(result=None, stream_request=None, params=None)
                job.finish = lambda row, job=job: setattr(job, "result", row)
                self.pool.bind(entry, job, tag=next(self.tags))
                self.pool.deliver(entry.session, torch.zeros(3))
            elif entry is not None:
                self.pool.deliver(entry, torch.zeros(3))
        self.pool.release()

    def lockstep(self, contexts, num_steps, batch_size):
        for step in range(num_steps):
            for start in range(0, len(contexts), batch_size):
                self.batch(contexts[start:start + batch_size])
            contexts = [c + [step + 1] for c in contexts]
        return contexts


@pytest.mark.parametrize(
    "num_contexts, batch_size, warns",
    [
        (4, 4, False),  # as many contexts as sessions, moving to new ones
        (8, 8, True),  # more contexts than sessions in one batch
        (8, 4, True),  # more contexts than sessions over two batches a step
    ],
)
def test_the_crowding_warning_counts_contexts_extended_at_once(num_contexts, batch_size, warns):
    steps = FakeSteps(capacity=4)
    contexts = [[i, 100 + i] for i in range(num_contexts)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        contexts = steps.lockstep(contexts, 3, batch_size)
        contexts = steps.lockstep([[200 + i, 7] for i in range(num_contexts)], 3, batch_size)
        steps.lockstep([contexts[i // 2] for i in range(num_contexts)], 3, batch_size)  # forks
    crowded = [w for w in caught if "max_num_seqs" in str(w.message)]
    assert len(crowded) == (1 if warns else 0)


def test_a_closed_session_is_freed_without_the_cycle_collector():
    """A session kept its capture target, ``partial(pool.deliver, session)``, after it was
    closed: a reference cycle per session, which only the cycle collector frees. The
    collector holds the GIL while it runs (and the event loop waits for it), and a program
    that opens and closes sessions quickly left thousands of them to it."""
    import gc
    from types import SimpleNamespace

    from genlm_backend.llm.prompts import PromptChecker
    from genlm_backend.llm.vllm.session_pool import Session, SessionPool

    targets = {}
    pool = SessionPool([].extend, 4, park=None, follow=targets.__setitem__, unfollow=targets.pop)
    checker = PromptChecker(100, None)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(3):
            (entry,) = pool.plan([checker.request([1, 2, 3 + i], None)], None)
            job = SimpleNamespace(result=None, batch=None, stream_request=None, params=object())
            pool.bind(entry, job, tag=i)
            assert targets[i] is entry.session.deliver
            pool.close(entry.session)
            del entry, job
        assert not targets and pool.stats()["num_live"] == 0
        gc.collect()
        left = [obj for obj in gc.garbage if isinstance(obj, Session)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
