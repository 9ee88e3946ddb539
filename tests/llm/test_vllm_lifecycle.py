"""AsyncVirtualLM lifecycle: two engines in one process, cleanup, context managers."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
from vllm_fixtures import GPU_ENGINE_OPTS, assert_matches, front_on_shared_engine

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
    # A wrapper around a live engine, closed by the context manager; its engine is not
    # shut down here because it is the shared one: only test the wrapper's own state.
    with front_on_shared_engine(vllm_lm.llm) as lm:
        assert lm.next_token_logprobs_sync([3, 4]).shape == (32000,)
    assert lm.is_closed
    with pytest.raises(RuntimeError):
        lm.next_token_logprobs_sync([3, 4])


@pytest.mark.slow
async def test_speculative_decoding_samples_and_lists_exact_rows(
    vllm_lm, tiny_model_dirs, hf_reference
):
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
    opts = {
        "dtype": "float32",
        "max_model_len": 128,
        "seed": 0,
        **GPU_ENGINE_OPTS,
        "speculative_config": {"method": "draft_model", "model": base, "num_speculative_tokens": 2},
    }
    lm = AsyncVirtualLM.from_name(base, engine_opts=opts)
    try:
        assert lm.llm.llm_engine.vllm_config.speculative_config is not None
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


def _engine_threads() -> set:
    import threading

    return {t for t in threading.enumerate() if t.name == "genlm-AsyncVirtualLM"}


def test_a_failed_from_name_shuts_down_the_engine_it_started(tiny_model_dirs, monkeypatch):
    """A constructor argument refused after the engine started: the engine is shut down and
    its memory freed, no engine thread is left, and a retry finds the process as it was."""
    import gc
    import weakref

    import vllm

    from genlm_backend.llm.vllm import AsyncVirtualLM, internals

    started = []

    class Recorded(vllm.LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(weakref.ref(self))

    monkeypatch.setattr(vllm, "LLM", Recorded)
    threads, registered = _engine_threads(), set(internals.engine_core._LIVE_ENGINES)
    with pytest.raises(TypeError, match="sessions must be"):
        AsyncVirtualLM.from_name(
            str(tiny_model_dirs["base"]),
            engine_opts={"dtype": "float32", "max_model_len": 128, **GPU_ENGINE_OPTS},
            sessions="many",
        )
    assert len(started) == 1
    assert _engine_threads() == threads
    # not counted among the live engines
    assert set(internals.engine_core._LIVE_ENGINES) == registered
    gc.collect()
    assert started[0]() is None  # nothing holds the engine: its weights and KV cache are freed


def test_a_failed_constructor_stops_its_engine_thread_and_leaves_the_engine_working(vllm_lm):
    """On an engine the caller built: what the constructor started stops; the engine is the
    caller's, and keeps working."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    threads = _engine_threads()
    with pytest.raises(TypeError, match="sessions must be"):
        AsyncVirtualLM(vllm_lm.llm, sessions="many")
    with pytest.raises(ValueError, match="max_batch_size"):
        AsyncVirtualLM(vllm_lm.llm, batch_size=0)
    assert _engine_threads() == threads
    assert vllm_lm.next_token_logprobs_sync([3, 4]).shape == (32000,)


def test_listing_refusal_names_max_logprobs():
    from genlm_backend.llm.vllm import listing_refusal

    assert listing_refusal(-1, 32000) is None
    assert listing_refusal(32000, 32000) is None
    message = listing_refusal(20, 32000)
    assert "max_logprobs=20" in message and "max_logprobs=-1" in message


async def test_a_lockstep_run_leaves_the_callers_thread_and_process_settings_as_they_were(vlm):
    """The backend changes nothing the caller owns: the event loop's thread keeps its CPU
    affinity during and after a lockstep run (``share_core=True``, now removed, pinned it to
    one core until the sessions were closed), and torch's thread count, the GIL switch
    interval and the garbage collector's settings stay the caller's."""
    import gc
    import os
    import sys

    import torch

    from genlm_backend.llm.vllm import AsyncVirtualLM

    def settings():
        return (
            os.sched_getaffinity(0),
            torch.get_num_threads(),
            sys.getswitchinterval(),
            gc.get_threshold(),
            gc.isenabled(),
        )

    with pytest.raises(TypeError, match="share_core"):
        AsyncVirtualLM(vlm.llm, share_core=True)
    before, seen = settings(), []
    contexts = [[5, 6, 7 + i] for i in range(4)]
    for _ in range(4):
        rows = await asyncio.gather(*(vlm.next_token_logprobs(c) for c in contexts))
        seen.append(settings())
        contexts = [c + [int(r.argmax())] for c, r in zip(contexts, rows)]
    vlm.close_sessions()
    assert all(s == before for s in seen), (before, seen)
    assert settings() == before


@pytest.mark.parametrize("caller", ["event loop", "another thread"])
async def test_cleanup_during_a_lockstep_step_returns_at_once_and_shuts_the_engine_down_once(
    tiny_model_dirs, monkeypatch, caller
):
    """``cleanup()`` while a lockstep program's batch is in flight (held sessions, vLLM's
    defaults for them): it returns within seconds, every awaiter gets ``ClosedError``, and
    the engine is shut down once, on its own thread. It used to leave the held sessions
    stepping until a 60 s stall timeout, then shut the engine down from the caller's thread
    as well."""
    import threading
    import time

    from vllm_fixtures import prompts_of

    from genlm_backend.exceptions import ClosedError
    from genlm_backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(
        str(tiny_model_dirs["base"]),
        engine_opts={"dtype": "float32", "max_model_len": 512, "max_num_seqs": 4, "seed": 0,
                     **GPU_ENGINE_OPTS},
    )
    engine_thread = lm.engine.thread._thread
    core = lm.llm.llm_engine.engine_core
    shutdowns, shutdown = [], core.shutdown

    def counted_shutdown(*args, **kwargs):
        shutdowns.append(threading.current_thread())
        return shutdown(*args, **kwargs)

    monkeypatch.setattr(core, "shutdown", counted_shutdown)
    contexts = prompts_of([5, 8, 9, 11], seed=3)
    errors = []

    async def particle(i):
        try:
            while True:
                row = await lm.next_token_logprobs(contexts[i])
                contexts[i] = contexts[i] + [int(row.argmax())]
        except Exception as exc:  # noqa: BLE001 - every awaiter's error is checked below
            errors.append(exc)

    particles = [asyncio.ensure_future(particle(i)) for i in range(len(contexts))]
    try:
        while lm.stats()["engine"]["num_steps"] < 12:
            await asyncio.sleep(0.001)
        assert not any(p.done() for p in particles)
        assert lm.stats()["sessions"]["num_live"] == len(contexts)  # held sessions
        start = time.perf_counter()
        if caller == "event loop":
            lm.cleanup()
        else:
            await asyncio.to_thread(lm.cleanup)
        took = time.perf_counter() - start
        await asyncio.wait_for(asyncio.gather(*particles), timeout=10)
    finally:
        lm.cleanup()
        for p in particles:
            p.cancel()
    assert took < 5, took
    assert len(errors) == len(contexts) and all(isinstance(e, ClosedError) for e in errors), errors
    engine_thread.join(timeout=10)
    assert not engine_thread.is_alive()
    assert shutdowns == [engine_thread]
