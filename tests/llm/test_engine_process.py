"""An engine in a process of its own (ProcessEngine): rows, lifecycle and failures, checked
from the program's side against the same engine in this process."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from process_engines import (
    LinkEngine,
    StuckEngine,
    pid_engine,
    refusing_engine,
)

from genlm_backend.exceptions import ClosedError, EngineError
from genlm_backend.llm import AsyncLM, ProcessEngine
from genlm_backend.llm.mock import MockEngine

V = 1000


def engine_children() -> list[int]:
    """Live (not zombie) engine processes whose parent is this process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"engine_process" in cmdline:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_rows_from_the_child_equal_the_engine_run_here():
    """A lockstep sampler with resampling and fresh contexts: every row equals the mock's own
    row for that context, computed in this process."""
    reference = MockEngine(V)
    lm = AsyncLM(None, ProcessEngine(MockEngine, V), batch_size=64)
    rng = random.Random(0)

    async def run():
        contexts = [[1, 2, 3 + i] for i in range(24)]
        for step in range(8):
            rows = await asyncio.gather(*[lm.next_token_logprobs(c) for c in contexts])
            for context, row in zip(contexts, rows):
                assert torch.equal(row, reference.row(context, None)), (step, context)
            contexts = [c + [int(torch.multinomial(r.exp(), 1))] for c, r in zip(contexts, rows)]
            if step % 3 == 2:  # resample: some particles copy others
                contexts = [list(rng.choice(contexts)) for _ in contexts]
            if step == 4:  # a fresh context of another length
                contexts[0] = [rng.randrange(V) for _ in range(40)]

    try:
        asyncio.run(run())
        rows = lm.batch_next_token_logprobs_sync([[5, 6], [5, 6, 7]])
        assert torch.equal(rows[1], reference.row([5, 6, 7], None))
    finally:
        lm.cleanup()


def test_requests_reach_the_child_linked_to_the_request_they_extend():
    lm = AsyncLM(None, ProcessEngine(LinkEngine), batch_size=64)

    async def run():
        contexts = [[1, 2, i] for i in range(6)]
        late = [4, 4, 4]
        first_late = await lm.next_token_logprobs(late)
        assert first_late[:3].tolist() == [3, 0, 0]
        for step in range(5):
            rows = await asyncio.gather(*[lm.next_token_logprobs(c) for c in contexts])
            for context, row in zip(contexts, rows):
                assert row[:3].tolist() == [len(context), step > 0, step > 0], (step, context)
            contexts = [c + [0] for c in contexts]
        # Extended after more batches than the child remembers: sent whole, still right.
        assert (await lm.next_token_logprobs(late + [1]))[:3].tolist() == [4, 0, 0]

    try:
        asyncio.run(run())
    finally:
        lm.cleanup()


def test_a_killed_engine_process_fails_every_awaiter_within_a_second(fresh_tmp):
    engine = ProcessEngine(StuckEngine)
    lm = AsyncLM(None, engine, batch_size=8)

    async def run():
        waiting = [asyncio.ensure_future(lm.next_token_logprobs([7, i])) for i in range(3)]
        await asyncio.sleep(0.5)  # the batch is in the child, stuck
        assert not any(w.done() for w in waiting)
        killed = time.monotonic()
        os.kill(engine.pid, signal.SIGKILL)
        for w in waiting:
            with pytest.raises(EngineError, match="exited"):
                await w
        assert time.monotonic() - killed < 1.0
        with pytest.raises(EngineError):  # later requests are refused the same way
            await lm.next_token_logprobs([1, 2])

    asyncio.run(run())
    assert not alive(engine.pid)  # reaped, not left a zombie
    assert lm.stats()["engine_process"] == {"pid": engine.pid, "running": False}
    started = time.monotonic()
    lm.cleanup()
    assert time.monotonic() - started < 2.0
    assert list(fresh_tmp.iterdir()) == []


def test_cleanup_while_a_batch_runs_returns_and_stops_the_child(fresh_tmp):
    engine = ProcessEngine(StuckEngine)
    lm = AsyncLM(None, engine, batch_size=8)

    async def run():
        waiting = asyncio.ensure_future(lm.next_token_logprobs([7, 1]))
        await asyncio.sleep(0.5)
        started = time.monotonic()
        lm.cleanup()
        assert time.monotonic() - started < 5.0
        with pytest.raises(ClosedError):
            await waiting

    asyncio.run(run())
    assert not alive(engine.pid)
    assert engine_children() == []
    assert list(fresh_tmp.iterdir()) == []


def test_a_request_error_reaches_its_caller_and_a_failed_batch_only_its_own():
    lm = AsyncLM(None, ProcessEngine(StuckEngine), batch_size=8)

    async def run():
        good, bad = await asyncio.gather(
            lm.next_token_logprobs([1, 2]), lm.next_token_logprobs([8, 2]),
            return_exceptions=True)
        assert torch.equal(good, torch.zeros(16))
        assert "no row for" in str(bad)
        with pytest.raises(EngineError, match="a batch with 9"):
            await lm.next_token_logprobs([9])
        assert torch.equal(await lm.next_token_logprobs([3]), torch.zeros(16))

    try:
        asyncio.run(run())
    finally:
        lm.cleanup()


def test_an_engine_that_cannot_be_built_raises_and_leaves_no_process():
    with pytest.raises(EngineError, match="cannot build: no weights") as raised:
        ProcessEngine(refusing_engine, "no weights")
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert engine_children() == []


def test_cancelling_one_awaiter_leaves_the_others_their_rows():
    reference = MockEngine(V)
    lm = AsyncLM(None, ProcessEngine(MockEngine, V), batch_size=8)

    async def run():
        tasks = [asyncio.ensure_future(lm.next_token_logprobs([2, i])) for i in range(4)]
        await asyncio.sleep(0)
        tasks[1].cancel()
        await asyncio.wait(tasks)
        assert tasks[1].cancelled()
        for i in (0, 2, 3):
            assert torch.equal(tasks[i].result(), reference.row([2, i], None))
        row = await asyncio.wait_for(lm.next_token_logprobs([2, 9]), timeout=30)
        assert torch.equal(row, reference.row([2, 9], None))

    try:
        asyncio.run(run())
    finally:
        lm.cleanup()


def test_two_engine_processes_live_side_by_side():
    a = AsyncLM(None, ProcessEngine(pid_engine), batch_size=8)
    b = AsyncLM(None, ProcessEngine(pid_engine), batch_size=8)

    async def run():
        return await asyncio.gather(a.next_token_logprobs([1]), b.next_token_logprobs([1]))

    try:
        row_a, row_b = asyncio.run(run())
        assert int(row_a[0]) == a.engine.pid % 1000 and int(row_b[0]) == b.engine.pid % 1000
    finally:
        a.cleanup()
        b.cleanup()
    assert engine_children() == []


def test_the_child_ends_when_the_program_process_dies():
    script = textwrap.dedent("""
        import os, signal, sys
        from genlm_backend.llm import ProcessEngine
        from genlm_backend.llm.mock import MockEngine
        engine = ProcessEngine(MockEngine, 10)
        print(engine.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 5.0
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


def test_a_batch_larger_than_the_ring_gets_a_larger_ring_and_exact_rows():
    """The child's ring holds 2 x 256 rows at first; a batch of 600 makes it take a larger
    one, and batches after it still come back exact."""
    reference = MockEngine(V)
    lm = AsyncLM(None, ProcessEngine(MockEngine, V), batch_size=1000)

    async def run():
        for size in (10, 600, 10, 700):
            contexts = [[size, i] for i in range(size)]
            rows = await asyncio.gather(*[lm.next_token_logprobs(c) for c in contexts])
            for context, row in zip(contexts, rows):
                assert torch.equal(row, reference.row(context, None))

    try:
        asyncio.run(run())
    finally:
        lm.cleanup()


def test_a_build_function_the_child_cannot_import_is_refused_before_any_process_starts():
    def local_build():  # inside a function: no name to import it by
        return MockEngine(V)

    before = engine_children()
    with pytest.raises(TypeError, match="top level of a module"):
        ProcessEngine(local_build)
    with pytest.raises(TypeError, match="cannot be sent"):
        ProcessEngine(MockEngine, lambda: V)
    assert engine_children() == before
