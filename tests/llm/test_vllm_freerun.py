"""Free-running sessions of AsyncVirtualLM (``sessions="free"``): vLLM draws each session's
next token itself, and a request that extends a context by that draw takes the row the
engine computed meanwhile.

Every row is compared with a plain transformers forward pass of the whole context (<= 1e-4
on CPU), so a session whose engine context differs from the caller's (a token appended that
the caller did not take, a row handed to the wrong request) fails. The draws are checked
against the rows they come with: vLLM's sampling parameters of a live session, and the
frequencies of many draws from one row.
"""

from __future__ import annotations

import asyncio
import importlib.util
import math
import types

import pytest
import torch
from vllm_fixtures import assert_matches, cpu_lora, prompts_of

from genlm_backend.exceptions import InvalidRequestError
from genlm_backend.sampling import TokenSampler

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


@pytest.fixture
def free(vlm):
    vlm.set_sessions("free")
    yield vlm
    vlm.close_sessions()
    vlm.set_sessions(True)


def counters(vlm):
    return vlm.stats()["free_sessions"]


async def particles(vlm, contexts, num_steps, sampler, lora_name=None):
    """Lockstep particles drawing with ``sampler``; returns every (context, row) they saw."""
    seen = []
    for _ in range(num_steps):
        rows = await asyncio.gather(*(vlm.next_token_logprobs(c, lora_name=lora_name) for c in contexts))
        seen += zip(contexts, rows)
        tokens = await asyncio.gather(*(sampler.sample(r) for r in rows))
        contexts = [c + [t] for c, t in zip(contexts, tokens)]
    return seen


async def test_particles_drawing_the_engines_tokens_extend_running_sessions(free, hf_reference):
    before = counters(free)
    sampler = TokenSampler(seed=0)
    seen = await particles(free, prompts_of([3, 10, 21], seed=50), 6, sampler)
    for context, row in seen:
        assert_matches(row, hf_reference("base", context))
    after = counters(free)
    assert after["num_opened"] - before["num_opened"] == 3  # one engine request per particle
    assert after["num_extended"] - before["num_extended"] == 15  # every later step took a running row
    assert after["num_missed"] == before["num_missed"]
    assert after["num_direct"] > before["num_direct"]  # some took their rows without a batch
    assert sampler.num_offered == 18  # every draw was the engine's


async def test_a_token_other_than_the_engines_draw_gets_its_own_exact_row(free, hf_reference):
    context = prompts_of([7], seed=51)[0]
    row = await free.next_token_logprobs(context)
    drawn = TokenSampler().sample_now(row)  # (a draw of the caller's own: the engine's stays unused)
    # Another likely token (two equal requests would be one): the engine drew at most one of these two.
    other = next(t for t in torch.argsort(row, descending=True)[:2].tolist() if t != drawn)
    before = counters(free)
    rows = await asyncio.gather(*(free.next_token_logprobs(context + [t]) for t in (other, drawn)))
    for token, extended in zip((other, drawn), rows):
        assert_matches(extended, hf_reference("base", context + [token]))
    after = counters(free)
    assert after["num_extended"] - before["num_extended"] + after["num_opened"] - before["num_opened"] == 2
    assert after["num_opened"] - before["num_opened"] >= 1


async def test_the_draw_is_handed_out_once_and_not_after_the_row_changed(free):
    sampler = TokenSampler(seed=3)
    context = prompts_of([6], seed=52)[0]
    row = await free.next_token_logprobs(context)
    first = await sampler.sample(row)
    assert sampler.num_offered == 1 and row[first].item() > -math.inf
    await sampler.sample(row)  # a second draw from the same row is the sampler's own
    assert sampler.num_offered == 1
    row2 = await free.next_token_logprobs(context + [first])
    row2 += 0.0  # changed in place: the engine's draw no longer stands for it
    await sampler.sample(row2)
    assert sampler.num_offered == 1


async def test_free_sessions_leave_vllms_draw_untouched(free):
    """The sampling parameters vLLM runs a free session with change nothing in its draw."""
    await free.next_token_logprobs(prompts_of([5], seed=53)[0])
    scheduler = free.underlying_model.llm_engine.engine_core.engine_core.scheduler

    def params_of_live_sessions():
        return [r.sampling_params for r in scheduler.requests.values()
                if "genlm_free" in (r.sampling_params.extra_args or {})]

    live = free._engine_thread.submit(params_of_live_sessions).result()
    assert live, "no free session is running"
    for params in live:
        assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k in (0, -1, None)
        assert params.min_p == 0.0 and params.repetition_penalty == 1.0
        assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
        assert not params.logit_bias and not params.allowed_token_ids and not params.bad_words
        assert params.seed is None and not params.min_tokens


async def test_the_engines_draws_follow_the_row(free):
    """200 engine draws from one row (top tokens' probabilities 0.59, 0.17, 0.15): a
    chi-square test over the top three tokens and the rest, at a false-alarm rate of about
    1e-6 (df 3: 30.7). A draw from the top two tokens only, or shifted by one id, lands far
    beyond it; a mild tempering (0.7) does not, which the test of the parameters catches."""
    context = prompts_of([4], seed=3)[0]
    probs = (await free.next_token_logprobs(context)).exp()
    top = torch.topk(probs, 3).indices.tolist()
    assert 0.3 < probs[top[0]].item() < 0.8, "the row is too sharp or too flat for this test"
    num_draws = 200
    counts = torch.zeros_like(probs)
    for _ in range(num_draws):  # one new session per draw (the cache is off)
        row = await free.next_token_logprobs(context)
        offered = row.__dict__.get("_genlm_draw")
        assert offered is not None, "the row came without the engine's draw"
        counts[offered[0]] += 1
    observed = [counts[t].item() for t in top] + [num_draws - sum(counts[t].item() for t in top)]
    expected = [num_draws * probs[t].item() for t in top]
    expected.append(num_draws - sum(expected))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert chi2 < 30.7, (observed, expected)
    assert counts[probs == 0].sum() == 0


async def test_the_engine_waits_one_row_ahead_and_idle_sessions_stop(free):
    first = prompts_of([3, 8], seed=55)
    await asyncio.gather(*(free.next_token_logprobs(c) for c in first))
    steps = free.stats()["engine"]["num_steps"]
    await asyncio.sleep(0.5)  # nobody asks: at most one row ahead, then the engine waits
    assert free.stats()["engine"]["num_steps"] - steps <= 2
    assert counters(free)["num_live"] == 2
    # 9 batches of one particle that extend neither (3 sessions: below the capacity of 7)
    await particles(free, prompts_of([2], seed=56), 9, TokenSampler(seed=6))
    assert counters(free)["num_live"] == 1  # the first two stopped after 8 idle batches
    free.close_sessions()
    scheduler = free.underlying_model.llm_engine.engine_core.engine_core.scheduler
    running, waiting = free._engine_thread.submit(scheduler.get_request_counts).result()
    assert running == waiting == 0


async def test_more_particles_than_slots_all_get_their_rows(free, hf_reference):
    # max_num_seqs=8: at most 7 free sessions run; the others run as one-row sessions.
    seen = await particles(free, prompts_of([2 + i for i in range(10)], seed=56), 3, TokenSampler(seed=1))
    for context, row in seen:
        assert_matches(row, hf_reference("base", context))
    assert counters(free)["num_live"] <= 7


async def test_bad_requests_fail_alone_among_free_sessions(free, hf_reference):
    good = prompts_of([5, 9], seed=57)
    results = await asyncio.gather(
        free.next_token_logprobs(good[0]), free.next_token_logprobs([]), free.next_token_logprobs([5, 10**9]),
        free.next_token_logprobs(good[1]), free.next_token_logprobs(good[1], lora_name="no-such-adapter"),
        return_exceptions=True,
    )
    assert isinstance(results[1], ValueError) and isinstance(results[2], ValueError)
    assert isinstance(results[4], (ValueError, InvalidRequestError))
    assert_matches(results[0], hf_reference("base", good[0]))
    assert_matches(results[3], hf_reference("base", good[1]))


async def test_a_cancelled_particle_leaves_the_others_running(free, hf_reference):
    contexts = prompts_of([4, 6, 8], seed=58)
    sampler = TokenSampler(seed=2)
    rows = await asyncio.gather(*(free.next_token_logprobs(c) for c in contexts))
    contexts = [c + [await sampler.sample(r)] for c, r in zip(contexts, rows)]
    tasks = [asyncio.ensure_future(free.next_token_logprobs(c)) for c in contexts]
    await asyncio.sleep(0)
    tasks[1].cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], asyncio.CancelledError)
    for i in (0, 2):
        assert_matches(results[i], hf_reference("base", contexts[i]))
    seen = await particles(free, [contexts[0], contexts[2]], 2, sampler)
    for context, row in seen:
        assert_matches(row, hf_reference("base", context))


async def test_sampling_runs_beside_free_sessions(free, hf_reference):
    contexts = prompts_of([3, 5], seed=59)
    sampler = TokenSampler(seed=4)
    walk = asyncio.ensure_future(particles(free, contexts, 4, sampler))
    samples = await free.batch_sample([contexts[0]] * 3, max_tokens=4, eos_token_ids=[], seed=7)
    assert len(samples) == 3 and all(len(s) == 4 for s in samples)
    for context, row in await walk:
        assert_matches(row, hf_reference("base", context))


@cpu_lora
async def test_free_sessions_are_kept_apart_per_adapter(free, hf_reference, tiny_model_dirs):
    free.add_new_lora(str(tiny_model_dirs["adapter"]), "ad")
    context = prompts_of([6], seed=60)[0]
    sampler = TokenSampler(seed=5)
    for lora_name, which in ((None, "base"), ("ad", "merged")):
        for ctx, row in await particles(free, [context], 3, sampler, lora_name=lora_name):
            assert_matches(row, hf_reference(which, ctx))


def test_sessions_take_no_other_string(vlm):
    with pytest.raises(ValueError):
        vlm.set_sessions("loose")


async def test_a_request_vllm_refuses_fails_alone(free, hf_reference, monkeypatch):
    from genlm_backend.llm import vllm_internals

    good, refused = prompts_of([5, 7], seed=61)
    original = vllm_internals.add_request

    def add_request(engine, request_id, prompt, params, lora_request):
        if list(prompt) == refused:
            raise ValueError("refused for the test")
        return original(engine, request_id, prompt, params, lora_request)

    monkeypatch.setattr(vllm_internals, "add_request", add_request)
    results = await asyncio.gather(free.next_token_logprobs(good), free.next_token_logprobs(refused),
                                   return_exceptions=True)
    assert isinstance(results[1], InvalidRequestError) and "refused for the test" in str(results[1])
    assert_matches(results[0], hf_reference("base", good))


async def test_turning_free_sessions_off_answers_the_request_in_flight_and_stops_them(free, hf_reference):
    context = prompts_of([6], seed=62)[0]
    sampler = TokenSampler(seed=7)
    row = await free.next_token_logprobs(context)
    extended = context + [await sampler.sample(row)]
    task = asyncio.ensure_future(free.next_token_logprobs(extended))
    await asyncio.sleep(0)  # queued
    await asyncio.get_running_loop().run_in_executor(None, free.set_sessions, True)
    assert_matches(await asyncio.wait_for(task, 60), hf_reference("base", extended))
    scheduler = free.underlying_model.llm_engine.engine_core.engine_core.scheduler
    deadline = asyncio.get_running_loop().time() + 30
    while free._engine_thread.submit(scheduler.get_request_counts).result() != (0, 0):
        assert asyncio.get_running_loop().time() < deadline, "a free session outlived turning them off"
        await asyncio.sleep(0.05)


def test_a_request_waiting_on_a_closed_session_gets_a_new_one_of_one_row_when_turned_off():
    """FreeSessions alone (no engine): closing a session a request waits on starts a new
    session for that request: a running one while free sessions are on, a one-row one once
    they are off (it ends by itself instead of running on unused)."""
    from genlm_backend.llm.prompts import LogprobsRequest
    from genlm_backend.llm.vllm_freerun import FreeSessions

    started, aborted, tags = [], [], iter(range(100))
    pool = FreeSessions(lambda s, ids, lora: started.append((s.tag, s.rows_left)), lambda: next(tags),
                        aborted.extend, lambda tag, target: None, lambda tag: None, max_model_len=64, capacity=4)
    batch = types.SimpleNamespace(set=lambda i, result: None)
    pool.start_batch([LogprobsRequest((5, 6, 7), None)], batch)
    assert started == [(0, 61)]
    pool.close_all()
    assert started[-1] == (1, 61) and len(aborted) == 1  # still waiting: a new running session
    pool.enabled = False
    pool.close_all()
    assert started[-1] == (2, 1) and len(aborted) == 2  # turned off: a one-row session


def pool_without_engine(**options):
    """FreeSessions with stand-ins for the engine: ``step(session, token)`` plays one engine
    step of a session (a row captured, then the token drawn from it); returns that row."""
    from genlm_backend.llm.vllm_freerun import FreeSessions

    started, aborted, targets, tags = [], [], {}, iter(range(100))
    pool = FreeSessions(lambda s, ids, lora: started.append(s), lambda: next(tags), aborted.extend,
                        targets.__setitem__, targets.pop, max_model_len=64, capacity=4, **options)

    def step(session, token):
        row = torch.randn(16).log_softmax(0)
        targets[session.tag](row)
        pool.tokens([(session.tag, [token])])
        return row

    return pool, started, aborted, step


async def test_a_request_extending_a_session_by_its_draw_takes_its_row_on_the_event_loop():
    """FreeSessions.take (no engine): the session's next row at once when the engine has
    computed it, a future resolved by the step that computes it otherwise, None for a request
    that extends the context by another token (it goes to a batch)."""
    from genlm_backend.llm.prompts import LogprobsRequest

    pool, started, aborted, step = pool_without_engine()
    rows = {}
    first = LogprobsRequest((5, 6, 7))
    pool.start_batch([first], types.SimpleNamespace(set=rows.__setitem__))
    session = started[0]
    row = step(session, 9)
    assert rows == {0: row} and first.kept is session
    ahead = step(session, 4)  # a step ahead of the caller
    second = LogprobsRequest((5, 6, 7, 9), parent=first)
    assert pool.take(second) is ahead and second.kept is session
    assert await TokenSampler(seed=0).sample(ahead) == 4  # the engine's draw comes with the row
    assert pool.take(LogprobsRequest((5, 6, 7, 9, 3), parent=second)) is None  # not the draw
    third = LogprobsRequest((5, 6, 7, 9, 4), parent=second)
    future = pool.take(third)
    assert isinstance(future, asyncio.Future) and not future.done()
    assert pool.take(LogprobsRequest((5, 6, 7, 9, 4), parent=second)) is None  # taken already
    assert pool.has_waiting()
    row = step(session, 2)
    assert await asyncio.wait_for(future, 5) is row and not pool.has_waiting()
    assert pool.stats()["num_direct"] == 2 and aborted == []


async def test_a_cancelled_direct_request_leaves_its_session_to_the_others():
    from genlm_backend.llm.prompts import LogprobsRequest

    pool, started, aborted, step = pool_without_engine()
    first, other = LogprobsRequest((5, 6, 7)), LogprobsRequest((8, 9))
    pool.start_batch([first, other], types.SimpleNamespace(set=lambda i, r: None))
    one, two = started
    step(one, 3)
    step(two, 1)
    futures = [pool.take(LogprobsRequest((5, 6, 7, 3), parent=first)),
               pool.take(LogprobsRequest((8, 9, 1), parent=other))]
    futures[0].cancel()
    step(one, 2)
    row = step(two, 6)
    assert await asyncio.wait_for(futures[1], 5) is row
    assert futures[0].cancelled() and aborted == []
