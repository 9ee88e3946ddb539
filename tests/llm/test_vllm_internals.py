"""The seam to vLLM's internals: fails loudly when the structures it relies on move.

Checked against vLLM 0.32.0 (CPU); the lead checks 0.26.0 (CUDA) with the same tests.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import types

import pytest
import torch
from vllm_fixtures import assert_matches

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]


def test_the_logits_processor_interface_has_the_shape_we_rely_on():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    assert {f.name for f in dataclasses.fields(BatchUpdate)} >= {
        "batch_size",
        "removed",
        "added",
        "moved",
    }
    assert {"SWAP", "UNIDIRECTIONAL"} <= set(MoveDirectionality.__members__)
    for name in ("apply", "update_state", "is_argmax_invariant"):
        assert name in LogitsProcessor.__abstractmethods__
    params = inspect.signature(LogitsProcessor.__init__).parameters
    assert list(params)[1:] == ["vllm_config", "device", "is_pin_memory"]
    assert SamplingParams(extra_args={"k": ["a", 1]}).extra_args == {"k": ["a", 1]}


def test_non_argmax_invariant_processors_run_before_penalties_and_for_greedy_batches():
    from vllm.v1.sample.sampler import Sampler

    source = inspect.getsource(Sampler.apply_logits_processors)
    assert "non_argmax_invariant" in source
    assert source.index("non_argmax_invariant") < source.index("apply_penalties")
    forward = inspect.getsource(Sampler.forward)
    assert forward.index("to(torch.float32)") < forward.index("apply_logits_processors")


def test_the_engine_offers_the_calls_we_make():
    from vllm.v1.engine.llm_engine import LLMEngine

    for name in (
        "add_request",
        "step",
        "abort_request",
        "has_unfinished_requests",
        "add_lora",
        "remove_lora",
    ):
        assert callable(getattr(LLMEngine, name)), name


def test_the_processor_follows_removed_added_and_moved_rows():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from genlm_backend.llm.vllm.capture import CaptureSink, LogprobsCaptureProcessor

    sink = CaptureSink()
    tags = [sink.new_tag() for _ in range(3)]
    proc = LogprobsCaptureProcessor(None, torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is False

    def added(index, tag):
        params = SamplingParams(extra_args=sink.extra_args(tag)) if tag else SamplingParams()
        return (index, params, [1], [])

    proc.update_state(
        BatchUpdate(
            3, removed=[], added=[added(0, tags[0]), added(1, 0), added(2, tags[1])], moved=[]
        )
    )
    proc.update_state(BatchUpdate(3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    proc.update_state(BatchUpdate(3, removed=[1], added=[], moved=[]))
    proc.update_state(BatchUpdate(3, removed=[], added=[added(1, tags[2])], moved=[]))
    logits = torch.randn(3, 10)
    out = proc.apply(logits.clone())
    assert torch.equal(out, logits)  # the logits are left unchanged
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(sink.take(tags[0]), expected[2])
    assert torch.allclose(sink.take(tags[1]), expected[0])
    assert torch.allclose(sink.take(tags[2]), expected[1])
    proc.update_state(
        BatchUpdate(3, removed=[], added=[], moved=[(1, 0, MoveDirectionality.UNIDIRECTIONAL)])
    )
    assert set(proc.rows) == {0, 2}


@pytest.mark.parametrize("rows", [(0, 1, 2, 3), (0, 2, 3)], ids=["contiguous", "gapped"])
def test_final_rows_go_to_their_targets_and_forced_tokens_win(rows):
    """With finality known (the runner's mask), each final row goes to its target inside the
    step, partial-prefill rows to nobody; the tokens ``on_step`` names become the only finite
    logits of their rows; rows of other requests are untouched."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from genlm_backend.llm.vllm.capture import CaptureSink, LogprobsCaptureProcessor

    sink = CaptureSink()
    partial = rows[-1]  # this row is a partial prefill this step
    sink.discarded = lambda n: np.array([i == partial for i in range(n)])
    tags = {i: sink.next_tag() for i in rows}
    got = {}
    for i, tag in tags.items():
        sink.expect(tag, lambda row, i=i: got.__setitem__(i, row))
    seen = []
    sink.on_step = lambda final: (
        seen.append(sorted(final)) or {tags[i]: 7 - i for i in rows if i != partial}
    )
    proc = LogprobsCaptureProcessor(None, torch.device("cpu"), False)
    added = [
        (
            i,
            SamplingParams(extra_args=sink.extra_args(tags[i])) if i in tags else SamplingParams(),
            [1],
            [],
        )
        for i in range(4)
    ]
    proc.update_state(BatchUpdate(4, removed=[], added=added, moved=[]))
    logits = torch.randn(4, 10)
    out = proc.apply(logits.clone())
    expected = torch.log_softmax(logits, -1)
    assert set(got) == set(rows) - {partial}
    for i, row in got.items():
        assert torch.allclose(row, expected[i])
    assert seen == [sorted(tags[i] for i in rows if i != partial)]
    for i in range(4):
        if i in tags and i != partial:
            assert torch.isfinite(out[i]).sum() == 1 and out[i, 7 - i] == 0
        else:
            assert torch.equal(out[i], logits[i])


@pytest.mark.parametrize("mask", [True, False], ids=["runner-mask", "no-mask"])
def test_a_worker_sends_the_final_rows_of_other_processes_sinks_with_its_output(mask):
    """In a worker process (no sinks of its own), the processor gathers the final rows of the
    engine process's sinks; they survive pickling as the step output's attribute (how vLLM's
    executor sends them) and reach their sink's slots; partial prefills, untagged rows and a
    step output shared by vLLM are left alone."""
    import pickle

    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
    from vllm.v1.sample.logits_processor import BatchUpdate

    from genlm_backend.llm.vllm import capture as vllm_capture
    from genlm_backend.llm.vllm import remote_rows
    from genlm_backend.llm.vllm.internals import remote as seam

    sink = vllm_capture.CaptureSink()
    tags = [sink.new_tag() for _ in range(3)]
    proc = vllm_capture.LogprobsCaptureProcessor(None, torch.device("cpu"), False)
    # rows 0, 2, 3 tagged; row 3 is a partial prefill (runner mask) or has an output token
    added = [(0, SamplingParams(extra_args=sink.extra_args(tags[0])), [1], []),
             (1, SamplingParams(), [1], []),
             (2, SamplingParams(extra_args=sink.extra_args(tags[1])), [1], []),
             (3, SamplingParams(extra_args=sink.extra_args(tags[2])), [1], [] if mask else [9])]
    proc.update_state(BatchUpdate(4, removed=[], added=added, moved=[]))
    remote = remote_rows.RemoteRows(
        (lambda n: np.array([i == 3 for i in range(n)])) if mask else None
    )
    logits = torch.randn(4, 10)
    vllm_capture._SINKS.pop(sink.token)  # as in a worker: the sink lives in another process
    vllm_capture.set_remote(remote)
    try:
        out = proc.apply(logits.clone())
    finally:
        vllm_capture.set_remote(None)
        vllm_capture._SINKS[sink.token] = sink
    assert torch.equal(out, logits)
    output = ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0})
    sent = seam._carrying(output, remote.take())
    assert sent is not output and not hasattr(output, seam._ROWS_ATTR)
    assert remote.take() is None  # handed over once
    received = pickle.loads(pickle.dumps(sent, protocol=pickle.HIGHEST_PROTOCOL))
    remote_rows.deliver_remote(getattr(received, seam._ROWS_ATTR))
    expected = torch.log_softmax(logits, -1)
    assert torch.allclose(sink.take(tags[0]), expected[0]) and torch.allclose(
        sink.take(tags[1]), expected[2]
    )
    with pytest.raises(RuntimeError):
        sink.take(tags[2])
    shared = seam._carrying(EMPTY_MODEL_RUNNER_OUTPUT, [])
    assert shared is not EMPTY_MODEL_RUNNER_OUTPUT and not hasattr(
        EMPTY_MODEL_RUNNER_OUTPUT, seam._ROWS_ATTR
    )


def test_an_async_output_carries_the_rows_once_it_is_made():
    from vllm.v1.outputs import ModelRunnerOutput

    from genlm_backend.llm.vllm.internals import remote as seam

    made = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    pending = types.SimpleNamespace(get_output=lambda: made)
    assert seam._carrying(pending, ["rows"]) is pending
    assert getattr(pending.get_output(), seam._ROWS_ATTR) == ["rows"]


def test_the_worker_calls_remote_capture_relies_on_are_where_it_expects():
    """``Worker.sample_tokens`` returns the runner's ``sample_tokens``; the executor reads one
    output rank; the engine core gives the step output to ``scheduler.update_from_output``."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    assert "self.model_runner.sample_tokens(" in inspect.getsource(Worker.sample_tokens)
    assert callable(GPUModelRunner.sample_tokens)
    assert "self.output_rank" in inspect.getsource(MultiprocExecutor)
    assert "self.scheduler.update_from_output(" in inspect.getsource(EngineCore.step)
    assert dataclasses.is_dataclass(ModelRunnerOutput) and not hasattr(
        ModelRunnerOutput, "__slots__"
    )


def test_the_step_calls_that_hold_sessions_over_workers_are_where_they_are_expected():
    """Holds over worker processes (``internals.remote``) rest on: the engine core's ``step``
    (used where ``batch_queue`` is None) asks the executor for ``execute_model(...,
    non_block=True)``, reads its result and calls ``sample_tokens(grammar_output)`` only when
    it is None; the worker's ``execute_model`` lets None through, leaving the logits in the
    runner's ``execute_model_state.logits`` with the logits processors' state (the batch
    updates) already applied; ``sample_tokens`` takes them; the processors are
    ``input_batch.logitsprocs.all``."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.worker.gpu_model_runner import ExecuteModelState, GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    step = inspect.getsource(EngineCore.step)
    assert "self.model_executor.execute_model(scheduler_output, non_block=True)" in step
    assert (
        "if model_output is None:" in step
        and "self.model_executor.sample_tokens(grammar_output)" in step
    )
    assert "self.step if self.batch_queue is None else" in inspect.getsource(EngineCore.__init__)
    assert "logits" in ExecuteModelState._fields
    runner_execute = inspect.getsource(GPUModelRunner.execute_model)
    assert "self.execute_model_state = ExecuteModelState(" in runner_execute
    assert runner_execute.index("_update_states(") < runner_execute.index(
        "self.execute_model_state = ExecuteModelState("
    )
    assert "self.execute_model_state" in inspect.getsource(GPUModelRunner.sample_tokens)
    assert "NoneType" in inspect.getsource(Worker.execute_model)
    assert callable(MultiprocExecutor.execute_model) and callable(MultiprocExecutor.sample_tokens)
    assert isinstance(LogitsProcessors.all, property)


def test_the_row_ring_is_sized_by_the_batches_vllm_runs_at_once():
    """The ring holds ``(depth + READ_LAG + 2) * max_rows`` rows for ``depth =
    max_concurrent_batches - 1``: the batch queue hands a step's output to the scheduler
    (popping the oldest batch) before it schedules the step after the next."""
    from vllm.config import VllmConfig
    from vllm.v1.engine.core import EngineCore

    assert isinstance(inspect.getattr_static(VllmConfig, "max_concurrent_batches"), property)
    source = inspect.getsource(EngineCore.step_with_batch_queue)
    assert source.index("batch_queue.pop()") < source.index("self.scheduler.update_from_output(")


def test_listed_rows_are_taken_from_marked_outputs_before_vllm_lists_them():
    """Marked requests' first listed row goes to ``deliver`` and leaves the output (vLLM then
    builds no Python lists for it); unmarked requests and steps without lists pass untouched;
    marks of requests that left without a token do not pile up."""
    import numpy as np
    from vllm.v1.outputs import LogprobsLists

    from genlm_backend.llm.vllm import internals

    seen: list[list[str]] = []

    class Processor:
        def __init__(self):
            self.request_states: dict[str, object] = {}

        def add_request(self, request, prompt, parent_req=None, request_index=0):
            self.request_states[request.request_id] = object()

        def process_outputs(self, outputs, engine_core_timestamp=None, iteration_stats=None):
            seen.append([o.request_id for o in outputs if o.new_logprobs is not None])
            return "processed"

    def request(request_id, extra_args):
        return types.SimpleNamespace(
            request_id=request_id, sampling_params=types.SimpleNamespace(extra_args=extra_args)
        )

    def lists(ids, values):
        return LogprobsLists(
            np.array(ids, dtype=np.int32), np.array(values, dtype=np.float32), np.zeros(len(ids))
        )

    engine = types.SimpleNamespace(output_processor=Processor())
    got = []
    assert internals.install_listed_rows(engine, "mark", lambda *args: got.append(args))
    processor = engine.output_processor
    processor.add_request(request("a-1", {"mark": ["sink", 7]}), None)
    processor.add_request(request("b-2", None), None)
    processor.add_request(request("c-3", {"mark": ["sink", 8]}), None)
    outputs = [
        types.SimpleNamespace(
            request_id="a-1",
            new_logprobs=lists([[2, 2, 0], [1, 1, 1]], [[-1.0, -1.0, -2.0], [0, 0, 0]]),
        ),
        types.SimpleNamespace(request_id="b-2", new_logprobs=lists([[3]], [[-0.5]])),
        types.SimpleNamespace(request_id="c-3", new_logprobs=None),  # a partial prefill
    ]
    assert processor.process_outputs(outputs, 1.0, iteration_stats=None) == "processed"
    assert seen == [["b-2"]] and outputs[0].new_logprobs is None
    ((mark, ids, values),) = got
    assert (
        mark == ["sink", 7] and ids.tolist() == [2, 2, 0] and values.tolist() == [-1.0, -1.0, -2.0]
    )
    outputs = [types.SimpleNamespace(request_id="c-3", new_logprobs=lists([[4]], [[-0.25]]))]
    processor.process_outputs(outputs)
    assert got[-1][0] == ["sink", 8] and got[-1][1].tolist() == [4]
    # Marked requests aborted before their first token: forgotten once they pile up.
    for i in range(200):
        processor.add_request(request(f"gone-{i}", {"mark": ["sink", i]}), None)
        del processor.request_states[f"gone-{i}"]
    processor.add_request(request("live-1", {"mark": ["sink", 999]}), None)
    processor.process_outputs([])
    processor.process_outputs(
        [types.SimpleNamespace(request_id="live-1", new_logprobs=lists([[5]], [[0.0]]))]
    )
    assert got[-1][0] == ["sink", 999] and len(got) == 3
    stale = types.SimpleNamespace(request_id="gone-5", new_logprobs=lists([[6]], [[0.0]]))
    processor.process_outputs([stale])
    assert len(got) == 3 and stale.new_logprobs is not None  # its mark was forgotten


def test_the_output_calls_listed_rows_relies_on_are_where_it_expects():
    """The engine hands each request to ``output_processor.add_request`` and each step's
    outputs to ``output_processor.process_outputs``; step outputs carry ``new_logprobs``, a
    ``LogprobsLists`` of NumPy arrays that the per-request processor skips when it is None."""
    from vllm.v1.engine import EngineCoreOutput
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.outputs import LogprobsLists

    assert "self.output_processor.add_request(" in inspect.getsource(LLMEngine.add_request)
    assert "self.output_processor.process_outputs(" in inspect.getsource(LLMEngine.step)
    assert list(inspect.signature(OutputProcessor.add_request).parameters)[1] == "request"
    assert (
        list(inspect.signature(OutputProcessor.process_outputs).parameters)[1]
        == "engine_core_outputs"
    )
    assert "new_logprobs" in EngineCoreOutput.__struct_fields__
    assert LogprobsLists._fields[:2] == ("logprob_token_ids", "logprobs")
    assert "if output.new_logprobs is not None:" in inspect.getsource(
        LogprobsProcessor.update_from_output
    )


def test_the_runner_calls_the_cpu_generator_rewind_relies_on_are_where_it_expects():
    """The runner's bookkeeping rewinds partial-prefill rows' generators through
    ``input_batch.generators.get``; the sampler draws with ``sampling_metadata.generators``,
    the input batch's own dict, keyed by request index."""
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    bookkeeping = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "self.input_batch.generators.get(" in bookkeeping and "set_offset(" in bookkeeping
    assert list(inspect.signature(Sampler.forward).parameters)[1:3] == [
        "logits",
        "sampling_metadata",
    ]
    assert "generators=self.generators" in inspect.getsource(InputBatch._make_sampling_metadata)


def test_prefer_spawned_workers_only_for_worker_processes(monkeypatch):
    from genlm_backend.llm.vllm import internals

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert internals.prefer_spawned_workers({"tensor_parallel_size": 1}) is False
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    assert internals.prefer_spawned_workers({"tensor_parallel_size": 2}) is True
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert internals.prefer_spawned_workers({"distributed_executor_backend": "mp"}) is False
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


class _SamplerShape:
    """What :class:`ForcedSampling` relies on in vLLM's ``Sampler`` and model runner, in
    miniature: ``forward`` runs the logits processors, then ``self.sample``; the runner
    copies ``[N, 1]`` sampled tokens to the host through ``_to_list``."""

    def __init__(self, processor, call_sample=True):
        self.processor, self.call_sample, self.sampled = processor, call_sample, 0

    def forward(self, logits, metadata):
        logits = self.processor.apply(logits)
        if not self.call_sample:  # a vLLM that moved the sampling elsewhere
            return logits.argmax(-1)
        return self.sample(logits, metadata)[0].to(torch.int32).unsqueeze(-1)

    def sample(self, logits, metadata):
        self.sampled += 1
        return logits.argmax(-1), None

    @staticmethod
    def to_list(sampled):
        return sampled.tolist()


def _forcing_step(num_rows, forced_rows, call_sample=True, logprobs=None):
    """A processor whose sink forces token ``7 - i`` in each of ``forced_rows`` (rows
    ``0..num_rows-1`` all capture), run through a ``_SamplerShape`` wrapped by a
    ``ForcedSampling``; returns (sampled [N, 1], the host copy, sampler, forcing, logits)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from genlm_backend.llm.vllm.capture import CaptureSink, LogprobsCaptureProcessor
    from genlm_backend.llm.vllm.forcing import ForcedSampling
    from genlm_backend.llm.vllm.internals import plain_greedy

    sink = CaptureSink()
    sink.discarded = lambda n: np.zeros(n, dtype=bool)
    tags = [sink.next_tag() for _ in range(num_rows)]
    sink.on_step = lambda final: {tags[i]: 7 - i for i in forced_rows}
    proc = LogprobsCaptureProcessor(None, torch.device("cpu"), False)
    added = [
        (i, SamplingParams(extra_args=sink.extra_args(tags[i])), [1], []) for i in range(num_rows)
    ]
    proc.update_state(BatchUpdate(num_rows, removed=[], added=added, moved=[]))
    sampler, forcing = _SamplerShape(proc, call_sample), ForcedSampling()
    sampler.forward = forcing.wrap_forward(sampler.forward)
    sampler.sample = forcing.wrap_sample(sampler.sample, plain_greedy)
    to_list = forcing.wrap_to_list(sampler.to_list)
    metadata = dataclasses.make_dataclass("Metadata", ["all_greedy", "max_num_logprobs"])(
        True, logprobs
    )
    logits = torch.randn(num_rows, 10)
    sampled = sampler.forward(logits.clone(), metadata)
    return sampled, to_list(sampled), sampler, forcing, logits


def test_a_step_whose_every_row_is_forced_takes_the_tokens_without_sampling():
    sampled, host, sampler, forcing, _ = _forcing_step(4, range(4))
    assert sampled.tolist() == host == [[7], [6], [5], [4]]
    assert sampler.sampled == 0 and forcing.num_skipped == 1


@pytest.mark.parametrize(
    "forced_rows, logprobs", [((1, 3), None), (range(4), 2)], ids=["some rows", "logprobs"]
)
def test_other_steps_force_through_the_logits_and_sample(forced_rows, logprobs):
    sampled, host, sampler, forcing, logits = _forcing_step(4, forced_rows, logprobs=logprobs)
    expected = [[7 - i] if i in forced_rows else [int(logits[i].argmax())] for i in range(4)]
    assert sampled.tolist() == host == expected
    assert sampler.sampled == 1 and forcing.num_skipped == 0


def test_forced_tokens_the_sampler_never_takes_fail_the_step_loudly():
    with pytest.raises(RuntimeError, match="did not take the forced tokens"):
        _forcing_step(4, range(4), call_sample=False)


def test_a_chunk_gives_a_parked_session_its_max_tokens_on_every_version(vlm):
    # vLLM 0.26's scheduler applies a chunk to a parked session without its max_tokens; the
    # wrapper adds it. A scheduler of that shape, then the engine's own.
    from genlm_backend.llm.vllm import internals
    from genlm_backend.llm.vllm.internals.installed import installed_on

    class Scheduler026:
        def _update_request_as_session(self, session, update):
            session.prompt_token_ids += update.prompt_token_ids  # max_tokens left as parked

    scheduler = Scheduler026()
    engine = type("Engine", (), {})()
    engine.engine_core = type(
        "Client", (), {"engine_core": type("Core", (), {"scheduler": scheduler})()}
    )()
    assert internals.install_chunk_max_tokens(engine) is True
    assert internals.install_chunk_max_tokens(engine) is True  # once
    session = types.SimpleNamespace(prompt_token_ids=[1, 2], max_tokens=3)
    scheduler._update_request_as_session(
        session, types.SimpleNamespace(prompt_token_ids=[4], max_tokens=500)
    )
    assert session.prompt_token_ids == [1, 2, 4] and session.max_tokens == 500
    engine_scheduler = vlm.llm.llm_engine.engine_core.engine_core.scheduler
    assert installed_on(engine_scheduler)["chunk_max_tokens"] is True
    params = inspect.signature(type(engine_scheduler)._update_request_as_session).parameters
    assert list(params)[1:] == ["session", "update"]


def test_parked_sessions_wait_where_the_bypass_takes_them_from(vlm):
    # install_parked_bypass relies on: parked requests in a deque of the scheduler's waiting
    # queues with the WAITING_FOR_STREAMING_REQ status, counted by
    # num_waiting_for_streaming_input. Parks one session and looks.
    import asyncio
    from collections import deque

    from vllm.v1.request import RequestStatus

    scheduler = vlm.llm.llm_engine.engine_core.engine_core.scheduler
    from genlm_backend.llm.vllm.internals.installed import installed_on

    assert installed_on(scheduler)["parked_bypass"] is True
    vlm.close_sessions()
    asyncio.run(vlm.next_token_logprobs([3, 5, 7, 11]))
    vlm.engine.thread.submit(lambda: None).result()  # other engine work: the session parks
    queues = {
        n: getattr(scheduler, n)
        for n in ("skipped_waiting", "kv_holding_waiting", "waiting")
        if isinstance(getattr(scheduler, n, None), deque)
    }
    parked = [
        (n, r)
        for n, q in queues.items()
        for r in q
        if r.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    ]
    assert len(parked) == 1 and scheduler.num_waiting_for_streaming_input == 1, (
        list(queues),
        parked,
    )
    vlm.close_sessions()
    assert scheduler.num_waiting_for_streaming_input == 0


def test_prefer_v1_model_runner_sets_the_variable_unless_the_caller_did(monkeypatch):
    from genlm_backend.llm.vllm import internals

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert internals.prefer_v1_model_runner() is True
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    assert internals.prefer_v1_model_runner() is False
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None  # (collected without vllm too)
    and importlib.util.find_spec("vllm.v1.worker.gpu.sample.logits_processor") is None,
    reason="this vLLM has no Model Runner V2 logits processors",
)
def test_model_runner_v2_would_refuse_the_capture_processor(vlm):
    # Why the V1 runner is asked for: V2's loader takes only its own processor type, and
    # the engine read the setting start_engine made while it was built (False also without
    # Triton).
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as RunnerV2Processor
    from vllm.v1.worker.gpu.sample.logits_processor import loader

    from genlm_backend.llm.vllm.capture import LogprobsCaptureProcessor

    assert not issubclass(LogprobsCaptureProcessor, RunnerV2Processor)
    with pytest.raises(ValueError, match="not a subclass"):
        loader._load_v2_logitsprocs_by_fqcns([LogprobsCaptureProcessor])
    assert vlm.llm.llm_engine.vllm_config.use_v2_model_runner is False


def test_the_sampler_and_runner_calls_forced_sampling_wraps_are_where_it_expects(vlm):
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from genlm_backend.llm.vllm.internals.installed import installed_on

    forward = inspect.getsource(Sampler.forward)
    assert forward.index("apply_logits_processors(") < forward.index("self.sample(")
    assert list(inspect.signature(Sampler.sample).parameters)[1:3] == [
        "logits",
        "sampling_metadata",
    ]
    assert "self._to_list(sampled_token_ids)" in inspect.getsource(GPUModelRunner._bookkeeping_sync)
    engine = vlm.llm.llm_engine
    runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    forcing = vlm.engine._forcing
    assert forcing is not None and installed_on(runner)["forced_sampling"] is forcing
    from genlm_backend.llm.vllm import internals

    assert internals.install_forced_sampling(engine, object()) is forcing  # once per runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "forced",
    [
        [(0, 3), (1, 5), (2, 7), (3, 0)],  # every row of the step (lockstep)
        [(1, 3), (2, 9)],  # a contiguous part
        [(0, 1), (2, 4), (3, 4)],  # gapped
        [(3, 6)],  # one row
    ],
    ids=["all", "part", "gapped", "one"],
)
def test_forcing_leaves_exactly_the_forced_token_possible(forced, dtype):
    """Against a row-by-row reference: forced rows are -inf but for a 0 at the token, other
    rows are untouched."""
    from genlm_backend.llm.vllm.forcing import force_tokens

    logits = torch.randn(4, 10).to(dtype)
    expected = logits.clone()
    for i, t in forced:
        expected[i] = float("-inf")
        expected[i, t] = 0.0
    force_tokens(logits, forced)
    assert torch.equal(logits, expected)


def test_rows_of_a_reduced_precision_step_are_the_float32_log_softmax():
    """bf16 logits (a bf16 model's step): the captured rows are fp32, equal to the log-softmax
    of the logits cast to fp32; for every row of the step and for some."""
    from genlm_backend.llm.vllm.capture import CaptureSink, _rows_of, _Staging

    logits = (3 * torch.randn(4, 50)).to(torch.bfloat16)
    staging = _Staging(torch.device("cpu"), False)
    assert _rows_of(logits, [0, 1, 2, 3], staging) is logits
    assert torch.equal(_rows_of(logits, [1, 3], staging), logits[[1, 3]])
    sink = CaptureSink()
    tags = [sink.new_tag() for _ in range(4)]
    rows = {i: (sink.token, tag, []) for i, tag in enumerate(tags)}
    sink.capture(logits, rows, False, staging)
    expected = torch.log_softmax(logits.float(), dim=-1)
    for i, tag in enumerate(tags):
        row = sink.take(tag)
        assert row.dtype == torch.float32 and torch.equal(row, expected[i])


def test_a_missing_row_is_an_error_never_a_wrong_row():
    from genlm_backend.llm.vllm.capture import CaptureSink

    sink = CaptureSink()
    tag = sink.new_tag()
    with pytest.raises(RuntimeError, match="delivered no row"):
        sink.take(tag)
    sink.put(999, torch.zeros(3))  # unexpected tags are ignored
    with pytest.raises(RuntimeError):
        sink.take(999)


def test_a_request_with_an_output_token_is_no_longer_captured():
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from genlm_backend.llm.vllm.capture import CaptureSink, LogprobsCaptureProcessor

    sink = CaptureSink()
    tag = sink.new_tag()
    proc = LogprobsCaptureProcessor(None, torch.device("cpu"), False)
    output_ids: list[int] = []
    proc.update_state(
        BatchUpdate(
            1,
            removed=[],
            added=[(0, SamplingParams(extra_args=sink.extra_args(tag)), [1], output_ids)],
            moved=[],
        )
    )
    first = torch.randn(1, 5)
    proc.apply(first)
    output_ids.append(3)  # the engine sampled the prompt's next token
    proc.apply(torch.randn(1, 5))
    assert torch.allclose(sink.take(tag), torch.log_softmax(first, -1)[0])


def test_engine_shutdown_still_ends_with_the_process_wide_teardown_we_suspend():
    from vllm.v1.engine import core as core_module

    assert callable(core_module.cleanup_dist_env_and_memory)
    assert "cleanup_dist_env_and_memory()" in inspect.getsource(core_module.EngineCore.shutdown)


@pytest.mark.parametrize("reuse_previous", [False, True], ids=["process_inputs", "from_previous"])
def test_a_streaming_session_appends_chunks_to_its_parked_request(
    vlm, hf_reference, reuse_previous
):
    """The session route (internals.add_session_chunk) on the raw engine: a chunk of
    ``max_tokens=1`` parks the request with its KV, the next chunk is prefilled alone (the
    throwaway token is dropped, the prompt is not doubled) and its row is the row of the
    whole context. Later chunks built from the previous chunk's engine request (the fast
    route sessions take) behave the same."""
    from vllm import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.request import RequestStatus

    from genlm_backend.llm.vllm import internals

    assert "resumable" in inspect.signature(InputProcessor.process_inputs).parameters
    engine = vlm.llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    sink = vlm.engine._sink
    context, request_id, previous = [], f"genlm-test-session-{reuse_previous}", None
    for chunk in ([5, 17, 300, 42, 9], [77], [78, 79]):
        context = context + chunk
        tag = sink.new_tag()
        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args=sink.extra_args(tag))
        added = internals.add_session_chunk(engine, request_id, chunk, params, None, previous)
        assert (
            added.prompt_token_ids == chunk
            and added.sampling_params.extra_args == params.extra_args
        )
        previous = added if reuse_previous else None
        for _ in range(10):
            outputs = engine.step()
            if any(o.request_id == request_id and internals.output_done(o) for o in outputs):
                break
        else:
            raise AssertionError("the chunk never finished")
        request = scheduler.requests[request_id]
        assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
        assert request.num_computed_tokens == len(context) == len(request.prompt_token_ids)
        row = sink.take(tag)
        assert_matches(row, hf_reference("base", context))
    internals.abort_requests(engine, [request_id])
    assert request_id not in scheduler.requests and not engine.has_unfinished_requests()


def test_held_sessions_rely_on_the_runner_mask_and_park_with_their_kv(vlm, hf_reference):
    """What holding needs from vLLM: the model runner's ``discard_request_mask`` (else rows
    could not leave inside their step and nothing would be held), and the scheduler honouring
    a ``max_tokens`` lowered during the step (:func:`internals.park`): a held session
    that other engine work interrupts waits for its next chunk with its context computed."""
    from vllm.v1.request import RequestStatus

    from genlm_backend.llm.vllm import internals

    engine = vlm.llm.llm_engine
    assert internals.discard_mask_reader(engine) is not None
    assert vlm.engine._holds
    scheduler = engine.engine_core.engine_core.scheduler
    context = [5, 17, 300, 42, 9, 11]
    vlm.next_token_logprobs_sync(context)
    requests = vlm.engine.thread.submit(lambda: dict(scheduler.requests)).result()  # ends the hold
    assert len(requests) == 1
    request = next(iter(requests.values()))
    assert request.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert request.num_computed_tokens == len(context)
    assert_matches(vlm.next_token_logprobs_sync(context + [7]), hf_reference("base", context + [7]))


def test_step_hooks_see_each_output_before_the_scheduler_does():
    """_before_update wraps ``update_from_output(scheduler_output, model_runner_output)`` once
    a scheduler; each hook sees the step output before the scheduler handles it."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from genlm_backend.llm.vllm.internals import remote

    assert list(inspect.signature(Scheduler.update_from_output).parameters)[1:3] == [
        "scheduler_output", "model_runner_output"]
    seen, calls = [], []

    class FakeScheduler:  # (weakly referable, as vLLM's)
        def update_from_output(self, so, out):
            return calls.append(out) or seen.append("update") or "done"

    scheduler = FakeScheduler()
    remote._before_update(scheduler, lambda so, out: seen.append(("first", out)))
    wrapper = scheduler.update_from_output
    remote._before_update(scheduler, lambda so, out: seen.append(("second", out)))
    assert scheduler.update_from_output is wrapper  # one wrapper, however many hooks
    assert scheduler.update_from_output(None, "out") == "done" and calls == ["out"]
    assert seen == [("first", "out"), ("second", "out"), "update"]


def test_remote_rows_go_through_the_ring_and_read_back_as_their_log_softmax():
    """A worker's capture writes a step's final rows into consecutive ring slots and sends
    where they are; a step with more rows than the ring takes goes as an array."""
    import pickle

    import numpy as np
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from genlm_backend.llm.row_ring import RowRing
    from genlm_backend.llm.vllm import capture as vllm_capture
    from genlm_backend.llm.vllm import remote_rows

    sink = vllm_capture.CaptureSink()
    tags = [sink.new_tag() for _ in range(3)]
    proc = vllm_capture.LogprobsCaptureProcessor(None, torch.device("cpu"), False)
    added = [
        (i, SamplingParams(extra_args=sink.extra_args(tag)), [1], []) for i, tag in enumerate(tags)
    ]
    proc.update_state(BatchUpdate(3, removed=[], added=added, moved=[]))
    ring = RowRing(torch.zeros(8, 10), max_rows=2)
    remote = remote_rows.RemoteRows(lambda n: np.zeros(n, dtype=bool), ring)
    vllm_capture._SINKS.pop(sink.token)
    vllm_capture.set_remote(remote)
    try:
        logits = torch.randn(3, 10)
        proc.apply(logits.clone())  # three rows: more than max_rows, sent as an array
        as_array = remote.take()
        proc.update_state(BatchUpdate(3, removed=[2], added=[], moved=[]))
        proc.apply(logits.clone())  # two rows: into the ring
        in_ring = remote.take()
    finally:
        vllm_capture.set_remote(None)
        vllm_capture._SINKS[sink.token] = sink
    assert isinstance(as_array[0][2], np.ndarray)
    assert in_ring == [(sink.token, tags[:2], (0, 2))]
    expected = torch.log_softmax(logits, -1)
    remote_rows.deliver_remote(pickle.loads(pickle.dumps(in_ring)), ring)
    ring.rows.zero_()  # what the sinks got are copies
    assert torch.allclose(sink.take(tags[0]), expected[0]) and torch.allclose(
        sink.take(tags[1]), expected[1]
    )


def test_underlying_model_is_the_torch_module_the_engine_runs(vlm, hf_reference):
    """``underlying_model`` (genlm-backend 0.3.1: the model runner's ``model``) is where
    ``internals.model_module`` finds it; vLLM moving it fails here, not in users' hooks."""
    from genlm_backend.llm.vllm import internals

    runner = (
        vlm.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    )
    module = vlm.underlying_model
    assert isinstance(module, torch.nn.Module) and module is runner.get_model()
    assert internals.model_module(vlm.llm) is module
    assert type(vlm.llm).__name__ == "LLM"  # the engine keeps its own name
    # The engine runs it: a forward hook on it sees the request's tokens.
    calls = []
    handle = module.register_forward_hook(lambda mod, args, output: calls.append(mod))
    try:
        prompt = [5, 900, 31000, 7]
        assert_matches(vlm.next_token_logprobs_sync(prompt), hf_reference("base", prompt))
    finally:
        handle.remove()
    assert calls and all(m is module for m in calls)


def test_model_module_names_why_the_model_is_not_in_this_process():
    from genlm_backend.llm.vllm import internals

    mp_engine_core = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=object()))
    with pytest.raises(RuntimeError, match="engine core in another process"):
        internals.model_module(mp_engine_core)
    workers = types.SimpleNamespace(model_executor=types.SimpleNamespace(workers=[]))
    elsewhere = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(engine_core=types.SimpleNamespace(engine_core=workers))
    )
    with pytest.raises(RuntimeError, match="workers are other processes"):
        internals.model_module(elsewhere)
