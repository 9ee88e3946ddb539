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
    """Particles need not keep in step (a sampler may run some ahead while others wait for
    a batch): the slow ones' parents must outlive the fast ones' next two steps."""
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


def test_the_prompt_check_benchmark_runs_and_reports_what_it_measured(tmp_path):
    """``benchmarks/bench_prompts.py`` at a tiny size: its table is its recorded runs."""
    import json
    import statistics
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_prompts.py",
            "--particles",
            "8",
            "--context",
            "20",
            "--steps",
            "2",
            "--runs",
            "3",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    payload = json.loads((tmp_path / "prompt_checks.json").read_text())
    (row,) = payload["rows"]
    runs = payload["runs_us"]
    assert (
        len(runs["checker"]) == len(runs["full"]) == 3 and min(runs["checker"] + runs["full"]) > 0
    )
    assert row["checker_us"] == statistics.median(runs["checker"]) and row[
        "full_us"
    ] == statistics.median(runs["full"])
    assert row["ratio"] == pytest.approx(
        statistics.median(c / f for c, f in zip(runs["checker"], runs["full"]))
    )
