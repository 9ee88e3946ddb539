"""PromptChecker: requests made from what callers pass, cheaply for prompts that extend one.

The reference is the full check (``check_token_ids``): every prompt the fast path takes must
come out as the same ids, and every prompt it refuses must fail as the full check fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.llm.prompts import LogprobsRequest, PromptChecker
from genlm_backend.llm.validation import check_token_ids

V = 100


def test_an_extension_is_linked_to_the_request_it_extends():
    checker = PromptChecker(V, max_len=10)
    first = checker.request([5, 6, 7], None)
    assert first.parent is None and first.token_ids == (5, 6, 7)
    second = checker.request([5, 6, 7, 8], None)
    assert second.parent is first and second.token_ids == (5, 6, 7, 8)
    assert second.token_ids[:3] is not None and all(type(t) is int for t in second.token_ids)
    other_adapter = checker.request([5, 6, 7, 9], "adapter")
    assert other_adapter.parent is None  # the same ids under another adapter are another prompt


@pytest.mark.parametrize("last, error", [
    (-1, InvalidRequestError), (V, InvalidRequestError), (2.0, InvalidRequestTypeError),
    (True, InvalidRequestTypeError), ("3", InvalidRequestTypeError),
])
def test_a_bad_last_id_fails_as_the_full_check_does(last, error):
    checker = PromptChecker(V, max_len=10)
    checker.request([5, 6], None)
    with pytest.raises(error):
        checker.request([5, 6, last], None)
    with pytest.raises(error):
        check_token_ids([5, 6, last], V, 10)


def test_an_extension_past_the_length_limit_fails():
    checker = PromptChecker(V, max_len=3)
    checker.request([1, 2, 3], None)
    with pytest.raises(InvalidRequestError, match="longer than"):
        checker.request([1, 2, 3, 4], None)


def test_every_id_is_a_plain_int_whatever_the_caller_passed():
    checker = PromptChecker(V, max_len=None)
    checker.request([np.int64(4), 5], None)  # the full check turns numpy ints into ints
    extended = checker.request([4, 5, 6], None)
    assert extended.parent is not None and [type(t) for t in extended.token_ids] == [int, int, int]
    # An id changed in place into an equal non-int is read as that int (documented).
    assert checker.request([4.0, 5, 6, 7], None).token_ids == (4, 5, 6, 7)
    # An unequal one is another prompt: full check, refused.
    with pytest.raises(InvalidRequestTypeError):
        checker.request([4.5, 5, 6, 7], None)


def test_equal_prompts_get_the_same_request():
    checker = PromptChecker(V, max_len=None)
    a = checker.request([1, 2, 3], None)
    assert checker.request((1, 2, 3), None) is a
    assert checker.request([1, 2, 3], "adapter") is not a


def remembered(checker):
    return checker._new, checker._old, checker._older


def test_requests_do_not_keep_their_ancestors_alive():
    checker = PromptChecker(V, max_len=None, remember=2)  # forgets fast
    first = checker.request([1, 2], None)
    context = [1, 2]
    for token in range(3, 40):
        context.append(token % V)
        last = checker.request(context, None)
    # A link to the parent only: neither the checker nor the chain holds the first request.
    assert last.parent is not None and last.parent.parent is None
    assert not any(r is first for gen in remembered(checker) for r in gen.values())


def test_requests_are_equal_by_prompt_and_adapter():
    a, b = LogprobsRequest((1, 2), None), LogprobsRequest((1, 2), None)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != LogprobsRequest((1, 2), "x") and a != LogprobsRequest((1, 3), None)
    assert tuple(a) == ((1, 2), None)


def test_the_prefix_hash_is_the_hash_of_the_prompt_without_its_last_id():
    import random

    from genlm_backend.llm import prompts

    assert prompts._prefix_hash is not None  # CPython's tuple hash: the O(1) route is on
    rng = random.Random(0)
    for _ in range(2000):
        ids = tuple(rng.randrange(200_000) for _ in range(rng.randrange(2, 400)))
        assert prompts._prefix_hash(hash(ids), len(ids), ids[-1]) == hash(ids[:-1])


@pytest.mark.parametrize("o1_prefix_hash", [True, False], ids=["prefix-hash", "hash-the-prefix"])
def test_lockstep_particles_find_their_parents_and_requests_die_young(monkeypatch, o1_prefix_hash):
    import random

    from genlm_backend.llm import prompts

    if not o1_prefix_hash:
        monkeypatch.setattr(prompts, "_prefix_hash", None)
    checker = PromptChecker(V, max_len=None)
    rng = random.Random(1)
    contexts = [[rng.randrange(V) for _ in range(20)] for _ in range(300)]
    previous = [checker.request(c, None) for c in contexts]
    for step in range(12):
        for i, context in enumerate(contexts):
            context.append(rng.randrange(V))
            request = checker.request(context, None)
            assert request.parent is previous[i] and request.token_ids == tuple(context)
            previous[i] = request
        # About three steps' requests are remembered, not thousands.
        assert sum(map(len, remembered(checker))) <= 4 * len(contexts)


def test_particles_two_steps_behind_the_others_find_their_parents():
    """Free-running sessions let particles whose rows are computed run ahead while others
    wait for a batch: the slow ones' parents must outlive the fast ones' next two steps."""
    import random

    checker = PromptChecker(V, max_len=None)
    rng = random.Random(2)
    fast = [[rng.randrange(V) for _ in range(20)] for _ in range(64)]
    slow = [[rng.randrange(V) for _ in range(20)] for _ in range(8)]
    previous = {id(c): checker.request(c, None) for c in fast + slow}
    for step in range(10):
        for group in ([fast] * 2 if step == 0 else [fast]) + [slow]:  # the fast run two steps ahead
            for context in group:
                context.append(rng.randrange(V))
                request = checker.request(context, None)
                assert request.parent is previous[id(context)]
                previous[id(context)] = request


def test_a_lone_context_extended_token_by_token_stays_linked():
    checker = PromptChecker(V, max_len=None)
    context = [1, 2, 3]
    request = checker.request(context, None)
    for token in range(500):
        context.append(token % V)
        nxt = checker.request(context, None)
        assert nxt.parent is request
        request = nxt
    assert sum(map(len, remembered(checker))) <= 3 * checker.min_remember + 3
    # Another adapter's prompts are other prompts: never linked across adapters.
    assert checker.request(context + [7], "adapter").parent is None
    assert checker.request(context + [7, 8], "adapter").parent is not None


def test_memory_is_bounded_when_nothing_extends():
    checker = PromptChecker(V, max_len=None, remember=50)
    for i in range(1000):
        checker.request([i % V, (i // V) % V, 7], None)
    assert sum(map(len, remembered(checker))) <= 150


# ---- the optional C passes (``_prompt_kernel``) against Python's own hash, == and + ----------

def _kernel():
    from genlm_backend.llm import prompts

    if prompts.KERNEL is None:
        pytest.skip("the compiled prompt kernel was not built")
    return prompts.KERNEL


def test_prompt_kernel_was_built_where_required():
    """CI sets ``GENLM_REQUIRE_PROMPT_KERNEL=1``: a silently skipped build fails here."""
    import os

    from genlm_backend.llm import prompts

    if os.environ.get("GENLM_REQUIRE_PROMPT_KERNEL") == "1":
        assert prompts.KERNEL is not None, (
            "genlm_backend.llm._prompt_kernel did not import (or failed its check at import): "
            "rerun `pip install -e .` and read its log"
        )
    else:
        _kernel()


class _Odd:
    """An id-like object with its own hash and equality (Python code runs for both)."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return hash(self.value)

    def __eq__(self, other):
        return self.value == getattr(other, "value", other)


def test_kernel_hashes_equal_the_builtin_tuple_hash():
    import random

    kernel = _kernel()
    rng = random.Random(2)
    odd_items = [2**61 - 1, 2**61, 2**63, 2**100, -1, -2, -(2**61) + 1, -(2**70), 0, 4.0, 4.5,
                 np.int64(7), True, "x", None, _Odd(3)]
    for _ in range(3000):
        length = rng.randrange(1, 50)
        items = [rng.randrange(-5, 300_000) for _ in range(length)]
        if rng.random() < 0.3:
            items[rng.randrange(length)] = rng.choice(odd_items)
        for seq in (items, tuple(items)):
            assert kernel.hashes(seq) == (hash(tuple(items)), hash(tuple(items[:-1])))


def test_kernel_hashes_refuses_what_python_refuses():
    kernel = _kernel()
    with pytest.raises(TypeError):
        kernel.hashes([1, [2], 3])  # an unhashable item
    with pytest.raises(TypeError):
        kernel.hashes(np.array([1, 2]))  # not a list or a tuple
    with pytest.raises(ValueError):
        kernel.hashes([])


def test_kernel_extend_equals_the_python_route():
    import random

    kernel = _kernel()
    rng = random.Random(3)
    for _ in range(3000):
        parent = tuple(rng.randrange(1000) for _ in range(rng.randrange(0, 40)))
        ids = list(parent) + [rng.randrange(1000)]
        roll = rng.random()
        if roll < 0.2 and parent:
            ids[rng.randrange(len(parent))] += 1  # differs somewhere
        elif roll < 0.3:
            ids.append(5)  # too long
        elif roll < 0.4 and parent:
            i = rng.randrange(len(parent))
            ids[i] = rng.choice([float(ids[i]), np.int64(ids[i]), _Odd(ids[i]), ids[i] + 0.5, "x"])
        expected = parent + (ids[-1],) if len(ids) == len(parent) + 1 and tuple(ids[:-1]) == parent else None
        for seq in (ids, tuple(ids)):
            got = kernel.extend(parent, seq)
            assert got == expected
            if got is not None:  # the parent's own items, then the caller's last one
                assert all(a is b for a, b in zip(got, parent)) and got[-1] is ids[-1]


def test_kernel_survives_a_list_changed_while_it_is_read():
    kernel = _kernel()

    class Shrinking:
        """Empties the list it sits in when compared or hashed."""

        def __init__(self, target):
            self.target = target

        def __eq__(self, other):
            self.target.clear()
            return True

        def __hash__(self):
            self.target.clear()
            return 1

    ids = [1, 2, 3, 4]
    ids[1] = Shrinking(ids)
    assert kernel.extend((1, 2, 3), ids) is None  # no crash; the prompt is not what it was
    ids = [1, 2, 3, 4]
    ids[1] = Shrinking(ids)
    with pytest.raises(RuntimeError, match="changed size"):
        kernel.hashes(ids)


@pytest.mark.parametrize("route", ["kernel", "python"])
def test_both_routes_make_the_same_requests(monkeypatch, route):
    """The lockstep pattern and the lenient and refused cases, through either route."""
    import random

    from genlm_backend.llm import prompts

    if route == "python":
        monkeypatch.setattr(prompts, "KERNEL", None)
    else:
        _kernel()
    checker = PromptChecker(V, max_len=None)
    rng = random.Random(4)
    contexts = [[rng.randrange(V) for _ in range(30)] for _ in range(50)]
    previous = [checker.request(c, None) for c in contexts]
    for _ in range(5):
        for i, context in enumerate(contexts):
            context.append(rng.randrange(V))
            request = checker.request(context, None)
            assert request.parent is previous[i] and request.token_ids == tuple(context)
            assert all(type(t) is int for t in request.token_ids)
            previous[i] = request
    context = contexts[0]
    assert checker.request([float(context[0])] + context[1:] + [3], None).token_ids == tuple(context) + (3,)
    with pytest.raises(InvalidRequestTypeError):
        checker.request([context[0] + 0.5] + context[1:] + [3], None)


def test_the_prompt_check_benchmark_runs_and_reports_what_it_measured(tmp_path):
    """``benchmarks/bench_prompts.py`` at a tiny size: its table is its recorded runs."""
    import json
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    _kernel()
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_prompts.py", "--particles", "8", "--context", "20", "--steps", "2",
         "--runs", "3", "--out-dir", str(tmp_path)],
        cwd=repo, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((tmp_path / "prompt_checks.json").read_text())
    (row,) = payload["rows"]
    runs = payload["runs_us"]
    assert len(runs["kernel"]) == len(runs["python"]) == 3 and min(runs["kernel"] + runs["python"]) > 0
    assert row["kernel_us"] == statistics.median(runs["kernel"]) and row["python_us"] == statistics.median(runs["python"])
    assert row["ratio"] == pytest.approx(statistics.median(k / p for k, p in zip(runs["kernel"], runs["python"])))


@pytest.mark.parametrize("remember, min_remember", [(200, 16), (30, 64)])
def test_the_kernel_extension_takes_the_python_steps(monkeypatch, remember, min_remember):
    """``_prompt_kernel.extension`` against ``PromptChecker._extension``: the same random
    workload (lockstep contexts, laggards, restarts, adapters, repeated prompts, generations
    that turn over) gives the same requests, linked to the same parents and shared where
    equal, and the same generations, through either route."""
    import random

    from genlm_backend.llm import prompts

    kernel = _kernel()

    def run(use_kernel):
        monkeypatch.setattr(prompts, "KERNEL", kernel if use_kernel else None)
        rng = random.Random(11)
        checker = PromptChecker(V, max_len=24, remember=remember, min_remember=min_remember)
        made: list[LogprobsRequest] = []
        record = []
        contexts = [([rng.randrange(V) for _ in range(rng.randint(1, 8))], rng.choice([None, "a", "b"]))
                    for _ in range(40)]
        for step in range(30):
            for i, (context, lora) in enumerate(contexts):
                roll = rng.random()
                if roll < 0.1:
                    continue  # a laggard this step
                if roll < 0.13:
                    contexts[i] = context, lora = [rng.randrange(V) for _ in range(3)], lora  # a restart
                elif roll < 0.16 and i:
                    contexts[i] = context, lora = list(contexts[i - 1][0]), contexts[i - 1][1]  # a copy
                else:
                    context.append(rng.randrange(V))
                try:
                    request = checker.request(context, lora)
                except InvalidRequestError:
                    record.append(("refused", len(context)))
                    continue
                same = next((k for k, r in enumerate(made) if r is request), None)
                parent = next((k for k, r in enumerate(made) if r is request.parent), None)
                record.append((request.token_ids, request.lora_name, same, parent, hash(request)))
                if same is None:
                    made.append(request)
            record.append((len(checker._new), len(checker._old), len(checker._older)))
        return record

    python, compiled = run(False), run(True)
    assert python == compiled
    assert any(r[3] is not None for r in python if len(r) == 5)  # extensions found their parents
    assert any(r[0] == "refused" for r in python)  # and the length limit was reached


def test_kernel_tuples_of_ints_are_left_to_reference_counting():
    """A request's tuple of plain ints can be in no reference cycle: the kernel untracks it
    (the collector would visit every id once to find that out); a tuple holding anything
    else stays tracked."""
    import gc

    kernel = _kernel()
    assert not gc.is_tracked(kernel.extend((1, 2), [1, 2, 3]))
    assert gc.is_tracked(kernel.extend((1, 2), [1, 2, [3]]))
    assert gc.is_tracked(kernel.extend((1, 2), [1.0, 2, 3]))  # equal, but read as the caller's
    checker = PromptChecker(V, max_len=None)
    checker.request([1, 2, 3], None)
    assert not gc.is_tracked(checker.request([1, 2, 3, 4], None).token_ids)
