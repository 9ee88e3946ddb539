"""Rows, held sessions and forced tokens on vLLM's Model Runner V2
(``internals.model_runner_v2``): the route a CUDA engine of a checked vLLM takes.

The engine tests need such an engine (they run on the GPU machine; a CPU engine runs vLLM's
V1 runner and is covered by the other vLLM tests). Every row is compared with a plain fp32
transformers forward pass of the whole context within ``ROW_ATOL`` (on CUDA vLLM's Triton
attention computes fp32 with TF32 dot products: 2e-2, see ``vllm_fixtures``), so a forced
token that did not reach the next step's input, a partial prefill taken for a final row, or a
row handed to the wrong request fails. Which route ran is read from vLLM's own objects.
"""

from __future__ import annotations

import asyncio
import importlib.util
import types
import typing

import numpy as np
import pytest
import torch
from vllm_fixtures import ENGINE_OPTS, assert_matches, prompts_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


def v2_engines_here() -> bool:
    if not torch.cuda.is_available():
        return False
    import vllm

    from genlm_backend.llm.vllm import internals

    return vllm.__version__ in internals.V2_CHECKED_VERSIONS


on_v2 = pytest.mark.skipif(
    not v2_engines_here(), reason="Model Runner V2 rows: a CUDA engine of a checked vLLM"
)


def batch_of(**fields):
    """An input batch as the runner hands it to its sampler: host arrays only."""
    return types.SimpleNamespace(num_draft_tokens=0, **fields)


def test_final_rows_are_the_rows_that_complete_a_prefill_grouped_by_sink():
    from genlm_backend.llm.vllm.internals.model_runner_v2 import final_rows

    batch = batch_of(
        num_reqs=5,
        idx_mapping_np=np.array([5, 2, 7, 1, 3], dtype=np.int32),
        num_computed_prefill_tokens_np=np.array([10, 0, 3, 4, 0], dtype=np.int32),
        num_scheduled_tokens=np.array([1, 8, 2, 4, 6], dtype=np.int32),
        prefill_len_np=np.array([10, 8, 9, 4, 6], dtype=np.int32),
    )
    tags = {5: ("a", 11), 2: ("b", 12), 7: ("a", 13), 3: ("a", 14), 9: ("a", 99)}
    # row 0: a decode step; row 1: a whole prefill; row 2: a partial prefill (3 + 2 < 9);
    # row 3: no tag; row 4: a prefill that ends in this step.
    assert final_rows(batch, tags) == {"a": [(0, 11), (4, 14)], "b": [(1, 12)]}
    batch.num_draft_tokens = 2  # speculative decoding: not this route's
    assert final_rows(batch, tags) == {}


class FakeBase:
    """vLLM's V2 sampler as the runner sees it: greedy tokens of the logits it is given."""

    def __init__(self):
        self.calls = 0
        self.added: list[tuple] = []
        self.penalties_state = "the base sampler's own"

    def add_request(self, slot, prompt_len, params):
        self.added.append((slot, prompt_len, params))

    def __call__(self, logits, input_batch):
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        self.calls += 1
        n = input_batch.num_reqs
        return SamplerOutput(sampled_token_ids=logits.argmax(-1).view(-1, 1),
                             logprobs_tensors=None, num_nans=None,
                             num_sampled=torch.ones(n, dtype=torch.int32),
                             num_rejected=torch.zeros(n, dtype=torch.int32))


class FakeSink:
    """A sink that records what it is handed and forces ``forced[tag]``."""

    def __init__(self, forced):
        self.forced, self.handed = forced, []

    def hand_over(self, logits, final, lists):
        self.handed.append([(i, tag, logits[i].clone()) for i, tag in final])
        return [(i, self.forced[tag]) for i, tag in final if tag in self.forced]


def params_with(capture):
    return types.SimpleNamespace(extra_args=None if capture is None else
                                 {"genlm_backend_capture": capture})


def four_rows(prefill_done=(True, True, False, True)):
    """Rows 0-3 at slots 3, 0, 1, 2; row 2 is a partial prefill unless said otherwise."""
    return batch_of(
        num_reqs=4, idx_mapping_np=np.array([3, 0, 1, 2], dtype=np.int32),
        num_computed_prefill_tokens_np=np.array([5, 0, 0, 9], dtype=np.int32),
        num_scheduled_tokens=np.array([1, 4, 2, 1], dtype=np.int32),
        prefill_len_np=np.array([5, 4, 2 if prefill_done[2] else 8, 9], dtype=np.int32),
        seq_lens=torch.tensor([6, 4, 2, 10], dtype=torch.int32),
    )


@pytest.fixture
def sampler_and_sink():
    from genlm_backend.llm.vllm.internals.model_runner_v2 import RowSampler
    from genlm_backend.llm.vllm.internals.row_sinks import SINKS

    sampler = RowSampler(FakeBase(), torch.device("cpu"))
    sink = FakeSink({})
    SINKS["test-sink"] = sink
    for slot, capture in ((0, ["test-sink", 10]), (1, ["test-sink", 11]), (2, None),
                          (3, ["test-sink", 13])):
        sampler.add_request(slot, 4, params_with(capture))
    yield sampler, sink
    SINKS.pop("test-sink", None)


def test_row_sampler_hands_final_tagged_rows_over_and_overwrites_forced_tokens(sampler_and_sink):
    sampler, sink = sampler_and_sink
    assert [slot for slot, _, _ in sampler.base.added] == [0, 1, 2, 3]  # passed through
    assert sampler.penalties_state == "the base sampler's own"  # the runner reads it
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    sink.forced = {13: 7}
    out = sampler(logits.clone(), four_rows())
    # Final tagged rows only: row 0 (slot 3, tag 13), row 1 (slot 0, tag 10); row 2 is a
    # partial prefill, row 3 has no tag.
    assert [(i, tag) for i, tag, _ in sink.handed[0]] == [(0, 13), (1, 10)]
    assert torch.equal(sink.handed[0][0][2], logits[0])
    expected = logits.argmax(-1)
    expected[0] = 7
    assert sampler.base.calls == 1 and out.sampled_token_ids.view(-1).tolist() == expected.tolist()
    assert sampler.num_skipped == 0


def test_row_sampler_skips_vllms_sampler_where_every_row_is_forced(sampler_and_sink):
    sampler, sink = sampler_and_sink
    sampler.add_request(2, 4, params_with(["test-sink", 12]))
    sink.forced = {10: 1, 11: 2, 12: 3, 13: 4}
    out = sampler(torch.zeros(4, 50), four_rows(prefill_done=(True, True, True, True)))
    assert sampler.base.calls == 0 and sampler.num_skipped == 1
    # rows 0-3 are slots 3, 0, 1, 2: tags 13, 10, 11, 12
    assert out.sampled_token_ids.view(-1).tolist() == [4, 1, 2, 3]
    assert out.num_sampled.tolist() == [1, 1, 1, 1] and out.num_rejected.tolist() == [0] * 4
    assert out.logprobs_tensors is None


def test_row_sampler_leaves_untagged_steps_to_vllm(sampler_and_sink):
    sampler, sink = sampler_and_sink
    for slot in range(4):  # plain requests take the slots over
        sampler.add_request(slot, 4, params_with(None))
    logits = torch.randn(4, 50)
    out = sampler(logits, four_rows())
    assert sink.handed == [] and sampler.base.calls == 1
    assert out.sampled_token_ids.view(-1).tolist() == logits.argmax(-1).tolist()


def test_the_route_is_refused_where_rows_cannot_come_from_model_runner_v2():
    from genlm_backend.llm.vllm import internals

    refusal = internals.runner_v2_refusal
    if not v2_engines_here():
        assert refusal({}) is not None
        return
    assert refusal({}) is None
    assert refusal({"enable_lora": True}) == "enable_lora"
    assert refusal({"tensor_parallel_size": 2}) == "tensor_parallel_size > 1"
    assert refusal({"logits_processors": [object]}) == "logits_processors"
    assert refusal({"worker_cls": "my.Worker"}) == "the caller's worker_cls"


@pytest.fixture(scope="module")
def v2_lm(tiny_model_dirs):
    from genlm_backend.llm.vllm import AsyncVirtualLM

    opts = {key: value for key, value in ENGINE_OPTS.items() if "lora" not in key}
    lm = AsyncVirtualLM.from_name(str(tiny_model_dirs["base"]), engine_opts=opts)
    yield lm
    lm.cleanup()


@on_v2
def test_the_engine_runs_model_runner_v2_and_stats_say_so(v2_lm):
    from genlm_backend.llm.vllm import internals

    assert v2_lm.stats()["engine"]["model_runner"] == "v2"
    assert internals.row_sampler(v2_lm.llm.llm_engine) is not None
    worker = v2_lm.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    assert type(worker.model_runner).__module__ == "vllm.v1.worker.gpu.model_runner"
    assert not v2_lm.llm.llm_engine.vllm_config.model_config.logits_processors


@on_v2
def test_rows_of_a_batch_spread_over_several_steps_match_a_plain_forward_pass(
    v2_lm, hf_reference
):
    # More prompts than max_num_seqs (8), and prompts longer than a step's 256 tokens.
    prompts = prompts_of([3, 40, 300, 17, 5, 260, 9, 12, 33, 8, 120], seed=1)
    v2_lm.set_sessions(False)
    try:
        rows = v2_lm.batch_next_token_logprobs_sync(prompts)
    finally:
        v2_lm.set_sessions(True)
    for prompt, row in zip(prompts, rows):
        assert_matches(row, hf_reference("base", prompt))


async def lockstep(lm, hf_reference, contexts, num_steps, resample_every=0):
    generator = torch.Generator().manual_seed(len(contexts) + num_steps)
    for step in range(num_steps):
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for context, row in zip(contexts, rows):
            assert_matches(row, hf_reference("base", context))
        tokens = [int(torch.multinomial(r.exp().cpu(), 1, generator=generator)) for r in rows]
        contexts = [c + [t] for c, t in zip(contexts, tokens)]
        if resample_every and step % resample_every == resample_every - 1:
            picks = torch.randint(len(contexts), (len(contexts),), generator=generator)
            contexts = [list(contexts[i]) for i in picks.tolist()]
    return contexts


@on_v2
def test_lockstep_sessions_are_held_and_take_their_forced_tokens(v2_lm, hf_reference):
    v2_lm.close_sessions()
    before = v2_lm.stats()
    asyncio.run(lockstep(v2_lm, hf_reference, prompts_of([5] * 6, seed=2), 12))
    after = v2_lm.stats()
    continued = after["sessions"]["num_continued"] - before["sessions"]["num_continued"]
    forced = after["engine"]["num_forced_steps"] - before["engine"]["num_forced_steps"]
    assert continued >= 6 * 10  # every step after the first two continues every session
    assert forced >= 10  # steps of held sessions alone skip vLLM's sampler


@on_v2
def test_resampled_contexts_match_a_plain_forward_pass(v2_lm, hf_reference):
    v2_lm.close_sessions()
    asyncio.run(lockstep(v2_lm, hf_reference, prompts_of([7] * 8, seed=3), 12, resample_every=3))


@on_v2
def test_sampling_beside_held_sessions_is_what_it_is_alone(v2_lm, hf_reference):
    prompts = prompts_of([6, 9, 4], seed=4)

    def sample():
        return v2_lm.batch_sample(prompts, max_tokens=8, eos_token_ids=[], seed=7)

    async def together():
        sampled = asyncio.ensure_future(sample())
        await lockstep(v2_lm, hf_reference, prompts_of([5] * 4, seed=5), 8)
        return await sampled

    v2_lm.close_sessions()
    beside = asyncio.run(together())
    alone = asyncio.run(sample())
    assert [list(s) for s in beside] == [list(s) for s in alone]
    assert [len(s) for s in beside] == [8, 8, 8]


def test_what_the_route_relies_on_is_where_it_was_in_this_vllm():
    """The names ``internals.model_runner_v2`` reads (its module docstring lists them)."""
    import dataclasses

    from vllm.v1.worker.gpu import input_batch, model_runner
    from vllm.v1.worker.gpu.sample.output import SamplerOutput
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu_worker import Worker

    fields = {f.name for f in dataclasses.fields(input_batch.InputBatch)}
    assert fields >= {
        "num_reqs", "idx_mapping_np", "num_scheduled_tokens", "num_computed_prefill_tokens_np",
        "prefill_len_np", "num_draft_tokens", "seq_lens",
    }
    assert {f.name for f in dataclasses.fields(SamplerOutput)} >= {
        "sampled_token_ids", "logprobs_tensors", "num_nans", "num_sampled", "num_rejected",
    }
    assert callable(Sampler.add_request) and callable(Sampler.__call__)
    assert callable(Worker.load_model)
    assert model_runner.GPUModelRunner.__module__ == "vllm.v1.worker.gpu.model_runner"


def test_rows_are_exact_with_async_scheduling_on(tiny_model_dirs, hf_reference):
    """With vLLM's async scheduling on, a parked session's next chunk never gave its row (seen
    on an H200 with vLLM 0.26, on both runners): sessions are off there, every request is a
    plain one, and the Model Runner V2 route is not taken."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    opts = {key: value for key, value in ENGINE_OPTS.items() if "lora" not in key}
    lm = AsyncVirtualLM.from_name(
        str(tiny_model_dirs["base"]), engine_opts={**opts, "async_scheduling": True}
    )
    try:
        assert lm.stats()["engine"]["model_runner"] == "v1"
        asyncio.run(lockstep(lm, hf_reference, prompts_of([6] * 5, seed=6), 6, resample_every=2))
        prompts = prompts_of([300, 4, 50], seed=7)
        for prompt, row in zip(prompts, lm.batch_next_token_logprobs_sync(prompts)):
            assert_matches(row, hf_reference("base", prompt))
        config = lm.llm.llm_engine.vllm_config.scheduler_config
        if config.async_scheduling:  # (a CPU engine turns it off: sessions are held there)
            assert lm.stats()["sessions"]["num_opened"] == 0
    finally:
        lm.cleanup()


class FakeLLM:
    """``vllm.LLM`` as ``startup.start_engine`` sees it: records each build's options and the
    runner choice the environment asked for."""

    builds: typing.ClassVar[list[dict]] = []

    def __init__(self, model, **opts):
        import os

        self.llm_engine = types.SimpleNamespace(name=f"engine {len(FakeLLM.builds)}")
        FakeLLM.builds.append({**opts, "env_runner": os.environ.get("VLLM_USE_V2_MODEL_RUNNER")})


@pytest.fixture
def fake_builds(monkeypatch):
    import vllm

    from genlm_backend.llm.vllm import internals

    FakeLLM.builds = []
    shut = []
    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(internals, "runner_v2_refusal", lambda opts: None)
    monkeypatch.setattr(internals, "shutdown", lambda llm: shut.append(llm.llm_engine.name))
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return shut


def test_an_engine_on_model_runner_v2_is_built_once_with_the_capture_worker(
    fake_builds, monkeypatch
):
    from genlm_backend.llm.vllm import internals, startup

    monkeypatch.setattr(internals, "row_sampler", lambda engine: object())
    startup.start_engine("a/model", {}, {"kv_cache_memory_bytes": 1 << 20}, can_capture=True)
    (build,) = FakeLLM.builds
    assert build["worker_cls"] == internals.CAPTURE_WORKER
    assert not build.get("logits_processors") and build["env_runner"] is None
    assert fake_builds == []


def test_an_engine_vllm_put_on_its_v1_runner_is_started_again_with_the_capture_processor(
    fake_builds, monkeypatch
):
    from genlm_backend.llm.vllm import internals, startup
    from genlm_backend.llm.vllm.capture import LogprobsCaptureProcessor

    monkeypatch.setattr(internals, "row_sampler", lambda engine: None)  # vLLM chose V1
    startup.start_engine("a/model", {}, {"kv_cache_memory_bytes": 1 << 20}, can_capture=True)
    first, second = FakeLLM.builds
    assert first["worker_cls"] == internals.CAPTURE_WORKER
    assert fake_builds == ["engine 0"]  # the first engine is shut down before the second starts
    assert "worker_cls" not in second and second["env_runner"] == "0"
    assert second["logits_processors"] == [LogprobsCaptureProcessor]
