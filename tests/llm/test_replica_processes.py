"""ProcessReplica: a backend in a child process (genlm_backend.llm.replicas.process).

Every child here serves the mock backend on a real tokenizer (the bundled SentencePiece
one, saved once per module to a folder that ``MockAsyncLM.from_name`` loads), so no test
needs vLLM, a GPU or the network. The reference of every row is an in-process
``MockAsyncLM`` on the same folder, ``reference.logprobs_of(token_ids, lora_name)``: the
mock's rows are the same code seeded by the token ids (and adapter name) alone, equal in
every process, so rows are compared exactly (``torch.equal``, tolerance zero).
"""

from __future__ import annotations

import asyncio
import os
import threading
import traceback

import pytest
import torch

from genlm_backend.exceptions import ClosedError, EngineError, InvalidRequestError
from genlm_backend.llm import MockAsyncLM, ReplicatedLM
from genlm_backend.llm.replicas import process
from genlm_backend.llm.replicas.process import ProcessReplica, start_replicas

WAIT = 30  # seconds any await may take before the test fails instead of hanging


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tests.real_tokenizers import load_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    load_tokenizer("sentencepiece").save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def reference(folder):
    lm = MockAsyncLM.from_name(folder)
    yield lm
    lm.cleanup()


def served(folder, kwargs):
    replica = ProcessReplica("mock", folder, kwargs)
    yield replica
    replica.cleanup()
    assert replica._child.process.returncode == 0


@pytest.fixture(scope="module")
def single(folder):
    yield from served(folder, {})


@pytest.fixture(scope="module")
def small(folder):
    """A replica whose child's batch size, so its ring's half, is 2 rows (the last test
    using it, test_cleanup_ends_the_child, cleans it up)."""
    yield from served(folder, {"batch_size": 2})


@pytest.fixture
def pair(folder):
    """Two replicas started side by side for one test; both children exit after it."""
    replicas = start_replicas("mock", folder, {}, [None, None])
    yield replicas
    for replica in replicas:
        replica.cleanup()
    assert all(r._child.process.returncode is not None for r in replicas)


def detach(wrapper):
    """Cleans a ReplicatedLM up without cleaning the replicas it was given."""
    wrapper.replicas = ()
    wrapper.cleanup()


def record(monkeypatch, replica):
    """Every message the parent sends to ``replica``'s child, in order."""
    sent, send = [], replica._send
    monkeypatch.setattr(replica, "_send", lambda message: (sent.append(message), send(message)))
    return sent


def entries(messages):
    return [e for m in messages if m[0] == "rows" for e in m[3]]


def kind(entry):
    return "handle" if type(entry) is int else {4: "extension", 3: "ids"}[len(entry)]


def assert_rows(reference, contexts, rows, lora_name=None):
    assert len(rows) == len(contexts)
    for context, row in zip(contexts, rows):
        assert row.dtype == torch.float32 and row.device.type == "cpu"
        assert torch.equal(row, reference.logprobs_of(context, lora_name)), context


async def gather(*awaitables, **options):
    return await asyncio.wait_for(asyncio.gather(*awaitables, **options), WAIT)


async def lockstep(lm, reference, contexts, steps, seed=0, extra=None):
    """Lockstep sampling, every row checked; ``extra(step, history)``: more contexts sent
    with a step. Returns every step's contexts."""
    generator = torch.Generator().manual_seed(seed)
    history = []
    for step in range(steps):
        more = extra(step, history) if extra else []
        rows = await gather(*(lm.next_token_logprobs(c) for c in contexts + more))
        assert_rows(reference, contexts + more, rows)
        history.append(contexts)
        probs = torch.stack(rows[: len(contexts)]).exp()
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1).tolist()
        contexts = [c + [t] for c, t in zip(contexts, tokens)]
    return history


# ---- rows ----------------------------------------------------------------------------------


async def test_lockstep_through_two_process_replicas_and_through_one(pair, single, reference):
    replicas = pair
    assert len({r.pid for r in replicas} | {os.getpid()}) == 3
    wrapper = ReplicatedLM(replicas)
    await lockstep(wrapper, reference, [[1, 1000 + i] for i in range(12)], steps=6)
    assert all(n > 0 for n in wrapper.stats()["routing"]["num_rows"])
    detach(wrapper)
    await lockstep(single, reference, [[1, 1100 + i] for i in range(12)], steps=6, seed=1)


async def test_lineage_travels_as_handles(single, reference, monkeypatch):
    sent = record(monkeypatch, single)
    marks = []  # where each step's messages begin
    contexts = [[1, 2000 + i] for i in range(12)]
    history = await lockstep(
        single, reference, contexts, steps=5, extra=lambda *_: marks.append(len(sent)) or []
    )
    handles = {}  # context -> its handle
    for step, contexts in enumerate(history):
        done = entries(sent[marks[step] : marks[step + 1] if step + 1 < len(marks) else None])
        assert [kind(e) for e in done] == ["ids" if step == 0 else "extension"] * 12
        if step == 0:
            handles.update((tuple(e[2]), e[0]) for e in done)
        else:
            of = {h: c for c, h in handles.items()}
            handles.update((of[e[2]] + (e[3],), e[0]) for e in done)
            assert {of[e[2]] + (e[3],) for e in done} == {tuple(c) for c in contexts}
        assert {e[1] for e in done} == {None}
    sent[:] = []

    wrapper = ReplicatedLM([single], cache_size=64)
    try:
        fresh = [[1, 2100 + i] for i in range(4)]
        assert_rows(reference, fresh, await gather(*map(wrapper.next_token_logprobs, fresh)))
        first = entries(sent)
        assert [kind(e) for e in first] == ["ids"] * 4
        sent[:] = []
        assert_rows(reference, fresh, await gather(*map(wrapper.next_token_logprobs, fresh)))
        assert entries(sent) == [] and wrapper.stats()["cache_hits"] == 4
        wrapper.clear_cache()
        assert any(m[0] == "call" and m[2] == "clear_cache" for m in sent)
        assert_rows(reference, fresh, await gather(*map(wrapper.next_token_logprobs, fresh)))
        assert sorted(entries(sent)) == sorted(e[0] for e in first)  # bare int handles
    finally:
        detach(wrapper)


async def test_generations_rotate_on_both_sides_at_once(single, reference, monkeypatch):
    monkeypatch.setattr(process, "REMEMBER", 5)
    sent = record(monkeypatch, single)

    def repeats(step, history):  # a context of the step before, and one of two steps before
        return [history[-1][0]] + ([history[-2][1]] if step >= 2 else []) if history else []

    contexts = [[1, 3000 + i] for i in range(8)]
    await lockstep(single, reference, contexts, steps=7, extra=repeats)
    rotations = [m[2] for m in sent if m[0] == "rows"]
    assert sum(rotations) >= 5, rotations
    assert "handle" in {kind(e) for e in entries(sent)}


async def test_a_batch_larger_than_a_ring_half_comes_inline(small, reference, monkeypatch):
    assert small.batch_size == 2
    inline = []
    on_rows = small._on_rows

    def recording(batch, start, errors, rows, ring):
        inline.append(rows is not None)
        on_rows(batch, start, errors, rows, ring)

    monkeypatch.setattr(small, "_on_rows", recording)
    wrapper = ReplicatedLM([small], batch_size=16)
    sizes = [5, 2, 5, 1, 2, 2, 6]
    for n, size in enumerate(sizes):
        contexts = [[1, 4000 + 10 * n + i] for i in range(size)]
        rows = await gather(*map(wrapper.next_token_logprobs, contexts))
        assert_rows(reference, contexts, rows)
    assert inline == [size > 2 for size in sizes]
    assert small._ring.rows.shape == (4, reference.vocab_size)  # two halves of 2 rows
    detach(wrapper)


# ---- adapters, calls, sampling ---------------------------------------------------------------


async def test_adapters_calls_and_stats_reach_the_child(single, reference, folder, monkeypatch):
    sent = record(monkeypatch, single)
    single.add_new_lora(folder, "a")
    assert ("add_new_lora", (folder, "a")) in [(m[2], m[3]) for m in sent if m[0] == "call"]
    ids = [[1, 5000, 5001], [1, 5002]]
    rows = await gather(*(single.next_token_logprobs(c, lora_name="a") for c in ids))
    assert_rows(reference, ids, rows, "a")
    assert not torch.equal(rows[0], reference.logprobs_of(ids[0]))
    assert_rows(reference, ids, await gather(*map(single.next_token_logprobs, ids)))
    single.remove_lora("a")
    assert ("remove_lora", ("a",)) in [(m[2], m[3]) for m in sent if m[0] == "call"]
    with pytest.raises(InvalidRequestError):
        await single.next_token_logprobs(ids[0], lora_name="a")
    with pytest.raises(InvalidRequestError):  # the child's own error, raised here
        single._call("remove_lora", "never-loaded").result(WAIT)
    stats = single.stats()
    assert stats["process"]["pid"] == single._child.process.pid != os.getpid()
    assert set(reference.stats()) <= set(stats["process"])


async def test_sample_goes_to_the_child(single, reference, monkeypatch):
    sent = record(monkeypatch, single)
    prompt, eos = [1, 6000, 6001], reference.tokenizer.eos_token_id
    got = await asyncio.wait_for(single.sample(prompt, 5, [eos], seed=3), WAIT)
    assert got == await reference.sample(prompt, 5, [eos], seed=3)
    assert [m[2] for m in sent] == ["sample"] and entries(sent) == []


async def test_cancelling_one_awaiter_harms_no_other(single, reference, monkeypatch):
    sent = record(monkeypatch, single)
    # The reader thread takes the child's rows only once task 2 is cancelled: the cancel
    # lands while the batch is with the child, however fast the child answers.
    cancelled, on_rows = threading.Event(), single._on_rows
    monkeypatch.setattr(single, "_on_rows", lambda *args: (cancelled.wait(WAIT), on_rows(*args)))
    contexts = [[1, 7000 + i] for i in range(6)] + [[1, 7002]]  # the last: task 2's twin
    tasks = [asyncio.create_task(single.next_token_logprobs(c)) for c in contexts]
    for _ in range(1000):
        if entries(sent):
            break
        await asyncio.sleep(0.001)
    assert entries(sent) and not tasks[2].done()  # the batch is with the child
    tasks[2].cancel()
    await asyncio.sleep(0)  # the cancellation reaches the task
    cancelled.set()
    results = await gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], asyncio.CancelledError)
    others = [i for i in range(len(contexts)) if i != 2]
    assert_rows(reference, [contexts[i] for i in others], [results[i] for i in others])
    assert_rows(reference, [contexts[2]], [await single.next_token_logprobs(contexts[2])])


# ---- failures and lifecycle --------------------------------------------------------------------


async def test_a_child_that_dies_fails_only_its_requests(pair, reference, folder, monkeypatch):
    replicas = pair
    routed = [set(), set()]
    for index, replica in enumerate(replicas):

        def recording(requests, index=index, evaluate=replica._evaluate_logprobs):
            routed[index].update(r.token_ids for r in requests)
            return evaluate(requests)

        monkeypatch.setattr(replica, "_evaluate_logprobs", recording)
    wrapper = ReplicatedLM(replicas)
    contexts = [[1, 8000 + i] for i in range(12)]
    rows = await gather(*map(wrapper.next_token_logprobs, contexts))
    assert_rows(reference, contexts, rows)
    assert all(routed)
    dead = replicas[0]
    dead._child.process.kill()
    dead._child.process.wait(WAIT)
    for share in routed:
        share.clear()
    contexts = [c + [int(r.argmax())] for c, r in zip(contexts, rows)]
    results = await gather(*map(wrapper.next_token_logprobs, contexts), return_exceptions=True)
    assert all(routed)
    for context, result in zip(contexts, results):
        if tuple(context) in routed[0]:
            assert isinstance(result, EngineError), result
        else:
            assert_rows(reference, [context], [result])
    with pytest.raises(EngineError):
        await asyncio.wait_for(dead.next_token_logprobs([1, 8100]), WAIT)
    with pytest.raises(EngineError):
        await asyncio.wait_for(dead.sample([1, 8101], 3, [2], seed=0), WAIT)
    with pytest.raises(EngineError):
        dead.add_new_lora(folder, "b")
    errors = []
    for _ in range(3):  # each caller gets an error of its own, its traceback not the others'
        with pytest.raises(EngineError) as info:
            ProcessReplica._evaluate_logprobs(dead, [])
        errors.append(info.value)
    assert len({id(e) for e in errors}) == 3
    assert all(len(traceback.extract_tb(e.__traceback__)) == 2 for e in errors)
    wrapper.cleanup()
    assert dead._child.process.returncode == -9 and replicas[1]._child.process.returncode == 0


def test_a_build_failure_raises_the_childs_traceback(monkeypatch):
    children = []

    class Recorded(process.Child):
        def __init__(self, *args):
            super().__init__(*args)
            children.append(self)

    monkeypatch.setattr(process, "Child", Recorded)
    with pytest.raises(EngineError) as info:
        ProcessReplica("mock", "/nonexistent/folder")
    text = str(info.value)
    assert "Traceback (most recent call last)" in text and "/nonexistent/folder" in text
    assert isinstance(info.value.__cause__, OSError)
    assert len(children) == 1 and children[0].process.poll() is not None


async def test_cleanup_ends_the_child(small, reference):
    assert_rows(reference, [[1, 9000]], [await small.next_token_logprobs([1, 9000])])
    small.cleanup()
    assert small._child.process.returncode == 0 and not small._reader.is_alive()
    with pytest.raises(ClosedError):
        await small.next_token_logprobs([1, 9001])
    with pytest.raises(ClosedError):
        await small.sample([1, 9002], 3, [2])


def test_the_heap_stays_frozen_while_started_replicas_live(folder, monkeypatch):
    """start_replicas freezes the collector's startup heap once (as vLLM's in-process engine
    does) and unfreezes it when the last replica it started is cleaned up, not before."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(process, "gc", SimpleNamespace(collect=lambda: calls.append("collect"),
                                                       freeze=lambda: calls.append("freeze"),
                                                       unfreeze=lambda: calls.append("unfreeze")))
    first = start_replicas("mock", folder, {}, [None, None])
    second = start_replicas("mock", folder, {}, [None])
    try:
        assert calls == ["collect", "freeze"]  # the second start finds it frozen already
        first[0].cleanup()
        second[0].cleanup()
        assert "unfreeze" not in calls  # first[1] still lives
    finally:
        first[1].cleanup()
        second[0].cleanup()
    assert calls == ["collect", "freeze", "unfreeze"]
    assert not process._HOLDING_GC


@pytest.mark.parametrize("callers", [None, "3"])
def test_a_gpu_replicas_process_gets_one_cpu_thread_unless_the_caller_chose(folder, monkeypatch,
                                                                             callers):
    """On a GPU (faked here), the child starts with ``OMP_NUM_THREADS=1``, as vLLM's GPU
    workers do; a value the caller set goes to the child as it is; this process's
    environment is left as it was."""
    from genlm_backend.llm.replicas import serve

    monkeypatch.setattr(serve, "_on_gpu", lambda: True)
    if callers is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", callers)
    replica = ProcessReplica("mock", folder)
    try:
        with open(f"/proc/{replica.pid}/environ", "rb") as f:
            variables = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        assert variables[b"OMP_NUM_THREADS"] == (b"1" if callers is None else callers.encode())
        assert os.environ.get("OMP_NUM_THREADS") == callers
    finally:
        replica.cleanup()


async def test_a_batch_sent_as_the_reader_ends_fails_instead_of_waiting(folder, monkeypatch):
    """The reader thread ends (the child exited) after a batch's check, and fails what is in
    flight before the batch is counted in flight: the batch fails at once rather than wait
    for a reply that never comes."""
    replica = ProcessReplica("mock", folder)
    try:
        send = replica._send

        def ending_first(message):
            if message[0] == "rows":  # _end ran, with nothing in flight then
                replica._failure = EngineError("the replica's process exited")
            send(message)

        monkeypatch.setattr(replica, "_send", ending_first)
        with pytest.raises(EngineError):
            replica._evaluate_logprobs([replica._request([1, 2, 3], None)])
        assert not replica._pending
    finally:
        replica.cleanup()


async def test_the_child_learns_every_handle_of_a_batch_it_cannot_read(folder, reference):
    """A batch with an entry the child cannot read (an unknown parent handle) fails as a
    whole, but the child still learns the batch's other handles, so a later batch that
    names one of them by its handle gets its row."""
    replica = ProcessReplica("mock", folder)
    loop = asyncio.get_running_loop()

    async def raw(batch, entries):
        future = loop.create_future()
        replica._pending[batch] = (future, loop, len(entries), 0.0)
        replica._send(("rows", batch, False, entries))
        return await asyncio.wait_for(future, WAIT)

    try:
        failed = await raw(-1, [(10**6, None, 10**7, 5), (10**6 + 1, None, (4, 5, 6))])
        assert all(isinstance(row, EngineError) for row in failed)
        [row] = await raw(-2, [10**6 + 1])
        assert torch.equal(row, reference.logprobs_of([4, 5, 6]))
    finally:
        replica.cleanup()
