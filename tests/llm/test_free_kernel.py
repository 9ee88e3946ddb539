"""The compiled hot paths of free-running sessions (``_free_kernel``) against the Python ones.

The reference is :class:`~genlm_backend.llm.vllm_freerun.FreeSessions` with
``use_kernel=False``. Two pools, one per route, get the same random sequence of batches,
engine steps (a row captured, then its token; now and then a token without its row), direct
takes (by the engine's draw, by another token, twice for one row), cancelled callers and
closed sessions. After every operation both must have handed out the same rows and errors,
started and aborted the same engine requests, and hold the same sessions in the same state.
No engine is needed: the pools get stand-ins that record what they are asked to do.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import types

import pytest
import torch

from genlm_backend.llm import vllm_freerun
from genlm_backend.llm.prompts import LogprobsRequest
from genlm_backend.llm.vllm_freerun import FreeSessions


def test_free_kernel_was_built_where_required():
    """CI sets ``GENLM_REQUIRE_FREE_KERNEL=1``: a silently skipped build fails here."""
    if os.environ.get("GENLM_REQUIRE_FREE_KERNEL") == "1":
        assert vllm_freerun.KERNEL is not None, (
            "genlm_backend.llm._free_kernel did not import: rerun `pip install -e .` and read its log"
        )
    elif vllm_freerun.KERNEL is None:
        pytest.skip("the compiled free-session kernel was not built")


needs_kernel = pytest.mark.skipif(vllm_freerun.KERNEL is None, reason="the free-session kernel was not built")


class Harness:
    """One pool and the engine stand-ins around it; results are recorded as values (a row by
    its content), so two harnesses can be compared."""

    def __init__(self, use_kernel: bool, capacity: int, max_model_len: int):
        self.targets: dict[int, object] = {}
        self.started: list[tuple[int, tuple[int, ...], int]] = []
        self.aborted: list[int] = []  # tags (engine request ids differ between pools)
        self._tag_of: dict[str, int] = {}
        self.delivered: list[tuple[str, int, object]] = []  # (batch name, slot, result)
        tags = itertools.count()
        self.pool = FreeSessions(self._start, tags.__next__, self._abort, self.targets.__setitem__,
                                 self.targets.pop, max_model_len=max_model_len, capacity=capacity,
                                 max_ahead=3, idle_batches=4, use_kernel=use_kernel)
        assert self.pool.kernel == use_kernel

    def _start(self, session, token_ids, lora_name):
        if token_ids[-1] == 99:  # the engine refuses this one
            raise ValueError("refused")
        self.started.append((session.tag, token_ids, session.rows_left))
        self._tag_of[session.request_id] = session.tag

    def _abort(self, request_ids):
        self.aborted.extend(self._tag_of[i] for i in request_ids)

    def batch(self, name: str):
        def record(slot, result):
            self.delivered.append((name, slot, describe(result)))
        return types.SimpleNamespace(set=record)

    def snapshot(self) -> list:
        sessions = sorted(self.pool._by_tag.values(), key=lambda s: s.tag)
        return [
            [(s.tag, s.rows_left, len(s.captured), len(s.ready), s.drawn, s.closed, s.last_used,
              None if s.key is None else s.key.token_ids, s.waiting is not None) for s in sessions],
            self.pool.stats(), self.pool.steps, list(self.started), list(self.aborted), list(self.delivered),
            sorted(self.targets),
        ]


def describe(result) -> object:
    if isinstance(result, torch.Tensor):
        return ("row", tuple(result.tolist()), getattr(result, "_genlm_draw", (None,))[0])
    if isinstance(result, BaseException):
        return ("error", type(result).__name__, str(result))
    if isinstance(result, asyncio.Future):
        return "future"
    return result


async def play(seed: int, use_kernel: bool, num_ops: int = 400) -> list:
    """A random workload on one route; returns the harness's snapshot after every operation
    and what each direct take returned (futures by their eventual result)."""
    rng = random.Random(seed)
    harness = Harness(use_kernel, capacity=rng.choice([3, 6]), max_model_len=rng.choice([12, 40]))
    pool, trace, futures = harness.pool, [], []
    heads: list[LogprobsRequest] = []  # each context's latest request
    draws = itertools.count(1)
    for op in range(num_ops):
        kind = rng.random()
        if kind < 0.15 or not heads:  # a batch: new contexts, and extensions of known ones
            requests = []
            for _ in range(rng.randint(1, 4)):
                if heads and rng.random() < 0.6:
                    parent = rng.choice(heads)
                    session = parent.kept
                    token = session.drawn if session is not None and rng.random() < 0.7 else rng.randrange(50)
                    requests.append(LogprobsRequest(parent.token_ids + (token,), parent.lora_name, parent))
                else:
                    ids = tuple(rng.randrange(50) for _ in range(rng.randint(1, 5)))
                    if rng.random() < 0.05:
                        ids += (99,)
                    requests.append(LogprobsRequest(ids, rng.choice([None, "a"])))
            pool.start_batch(requests, harness.batch(f"b{op}"))
            heads = (heads + requests)[-12:]
        elif kind < 0.5:  # an engine step: rows, then tokens, for some running sessions
            tags = [t for t in sorted(harness.targets) if rng.random() < 0.8]
            found = []
            for tag in tags:
                if rng.random() < 0.97:
                    harness.targets[tag](torch.tensor([float(tag), float(op)]))
                found.append((tag, [next(draws) % 50]))
            pool.begin_step()
            pool.tokens(found)
        elif kind < 0.85:  # direct takes
            parent = rng.choice(heads)
            session = parent.kept
            token = session.drawn if session is not None and rng.random() < 0.85 else rng.randrange(50)
            request = LogprobsRequest(parent.token_ids + (token,), parent.lora_name, parent)
            taken = pool.take(request)
            trace.append(("take", op, describe(taken)))
            if isinstance(taken, asyncio.Future):
                futures.append((op, taken))
                if rng.random() < 0.1:
                    taken.cancel()
            if taken is not None:
                heads = (heads + [request])[-12:]
        elif kind < 0.9:
            pool.close_where(lambda s, op=op: s.tag % 3 == op % 3)
        elif rng.random() < 0.3:
            pool.close_all()
        await asyncio.sleep(0)  # futures resolved through the loop
        trace.append(harness.snapshot())
    pool.fail_all(lambda: RuntimeError("shut down"))
    await asyncio.sleep(0)
    trace.append([(op, "cancelled" if f.cancelled() else describe(f.exception() or f.result()))
                  for op, f in futures if f.done()])
    trace.append(harness.snapshot())
    return trace


@needs_kernel
@pytest.mark.parametrize("seed", range(12))
async def test_the_compiled_sessions_do_what_the_python_sessions_do(seed):
    python, compiled = await play(seed, False), await play(seed, True)
    for step, (a, b) in enumerate(zip(python, compiled)):
        assert a == b, f"the routes part at step {step}"
    assert len(python) == len(compiled)
    # The workload reached the paths worth comparing.
    stats = python[-1][1]
    assert stats["num_direct"] > 0 and stats["num_opened"] > 1


@needs_kernel
async def test_use_kernel_switches_routes_on_a_live_pool():
    harness = Harness(True, capacity=4, max_model_len=20)
    pool = harness.pool
    first = LogprobsRequest((1, 2))
    pool.start_batch([first], harness.batch("b"))
    tag = next(iter(harness.targets))
    harness.targets[tag](torch.tensor([1.0]))
    pool.tokens([(tag, [7])])
    assert pool.use_kernel(False) is False and "take" not in vars(pool)
    harness.targets[tag](torch.tensor([2.0]))
    pool.tokens([(tag, [8])])  # the Python route, same pool
    assert pool.use_kernel(True) is True
    row = pool.take(LogprobsRequest((1, 2, 7), None, first))
    assert isinstance(row, torch.Tensor) and row.tolist() == [2.0] and row._genlm_draw[0] == 8
    assert harness.delivered == [("b", 0, ("row", (1.0,), 7))]


@needs_kernel
def test_the_kernel_passes_errors_of_the_objects_it_is_given_through():
    kernel = vllm_freerun.KERNEL
    with pytest.raises(TypeError):
        kernel.take(object(), object())
    with pytest.raises(TypeError):
        kernel.tokens(object(), 5)
    with pytest.raises(TypeError, match="pairs"):
        kernel.resolve([object()])
    harness = Harness(True, capacity=2, max_model_len=10)
    with pytest.raises(TypeError, match="pairs"):
        kernel.tokens(harness.pool, [(1, 2, 3)])
    # The pool's lock is released after an error: the next call goes through.
    assert harness.pool._lock.acquire(blocking=False)
    harness.pool._lock.release()


@needs_kernel
def test_the_free_paths_benchmark_runs_and_reports_what_it_measured(tmp_path):
    """``benchmarks/bench_free_paths.py`` at a tiny size: its table is its recorded runs."""
    import json
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_free_paths.py", "--particles", "8", "--steps", "3", "--runs", "3",
         "--out-dir", str(tmp_path)],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((tmp_path / "free_paths.json").read_text())
    (row,) = payload["rows"]
    for key, runs in payload["runs_us"].items():
        assert len(runs) == 3 and min(runs) > 0
        assert row[f"{key}_us"] == statistics.median(runs)
