"""What the prompt checker keeps alive: counted, not inferred from the lengths of its dicts.

Every path through ``PromptChecker.request`` (an extension found, an equal prompt again, a
miss, a parent under another adapter, a parent of equal hash but other ids, an unhashable
id, an id whose hash raises, ids the full check refuses) must leave behind exactly what the
checker holds: no extra reference to its generation dicts, to the caller's list or to its
ids, and no request that neither the checker nor the caller can reach. Requests are counted
among all objects the collector tracks (``gc.get_objects()``), references by
``sys.getrefcount``.
"""

from __future__ import annotations

import gc
import sys

import pytest

from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError
from genlm_backend.llm.prompts import LogprobsRequest, PromptChecker

V = 100


def generations(checker):
    return checker._new, checker._old, checker._older


def live_requests(ignore=frozenset()):
    """The ids of every live request the collector tracks, less ``ignore``."""
    return {id(o) for o in gc.get_objects() if type(o) is LogprobsRequest} - ignore


def reachable(checker, *held):
    """The ids of the requests the checker and ``held`` keep alive (each with its parent)."""
    roots = [r for gen in generations(checker) for r in gen.values()] + [
        r for r in held if r is not None
    ]
    return {id(r) for root in roots for r in (root, root.parent) if r is not None}


def references(checker, objects):
    """``sys.getrefcount`` of each of ``objects``, less the references the checker's
    attributes hold (the generations turn over, so which dict it holds changes)."""
    return [sys.getrefcount(o) - sum(o is g for g in generations(checker)) for o in objects]


class RaisingHash:
    def __hash__(self):
        raise RuntimeError("no hash for this id")


def paths():
    """(name, setup prompts, prompt, adapter, expected error or None)."""
    return [
        ("extension", [[5, 6, 7]], [5, 6, 7, 8], None, None),
        ("extension from a tuple", [[5, 6, 7]], (5, 6, 7, 8), None, None),
        ("equal prompt again", [[5, 6, 7, 8]], [5, 6, 7, 8], None, None),
        ("lenient extension", [[5, 6, 7]], [5.0, 6, 7, 8], None, None),
        ("miss", [[5, 6, 7]], [9, 9, 9, 8], None, None),
        ("parent under another adapter", [[5, 6, 7]], [5, 6, 7, 8], "a", None),
        # 2**61 - 1 hashes as 0: the parent (0, 6) is found, and its ids are not these
        ("parent of equal hash, other ids", [[0, 6]], [2**61 - 1, 6, 8], None, InvalidRequestError),
        ("unhashable id", [[5, 6, 7]], [5, [6], 7, 8], None, InvalidRequestTypeError),
        ("hash raises", [[5, 6, 7]], [RaisingHash(), 6, 7, 8], None, RuntimeError),
        ("bad last id", [[5, 6, 7]], [5, 6, 7, V], None, InvalidRequestError),
        (
            "too long",
            [[1, 2, 3, 4, 5, 6, 7, 8]],
            [1, 2, 3, 4, 5, 6, 7, 8, 9],
            None,
            InvalidRequestError,
        ),
        ("one id", [], [5], None, None),
    ]


@pytest.mark.parametrize("min_remember", [1, 64], ids=["generations-turn-over", "generations-stay"])
@pytest.mark.parametrize("name, setup, prompt, lora, error", paths(), ids=[p[0] for p in paths()])
def test_every_path_leaves_only_what_the_checker_holds(
    name, setup, prompt, lora, error, min_remember
):
    checker = PromptChecker(V, max_len=8, min_remember=min_remember)
    kept = [checker.request(ids, None) for ids in setup]
    before = live_requests()
    # the caller's list and its ids, less small ints (shared by every tuple that holds them)
    watched = [
        *generations(checker),
        prompt,
        *(t for t in prompt if not (type(t) is int and t <= 256)),
    ]
    refs = references(checker, watched)
    for _ in range(3):  # once as a first sight, then as a prompt the checker has seen
        request = None
        try:
            request = checker.request(prompt, lora)
        except Exception as exc:  # noqa: BLE001 - checked just below, then dropped with its traceback
            assert error is not None and isinstance(exc, error), repr(exc)
        else:
            assert error is None and request.token_ids == tuple(int(t) for t in prompt)
        assert references(checker, watched) == refs, name
        stray = live_requests(before) - reachable(checker, request, *kept)
        assert not stray, f"{name}: {len(stray)} requests alive that nothing reachable holds"
        del request


def test_misses_leave_no_requests_behind():
    """Unrelated prompts (every one a miss): the checker holds at most its three
    generations, and nothing else survives."""
    checker = PromptChecker(V, max_len=None, remember=50)
    before = live_requests()
    for i in range(5000):
        checker.request([i % V, (i // V) % V, 7], None)
    alive = live_requests(before)
    assert len(alive) <= 150, (
        f"{len(alive)} requests alive after 5000 misses (the checker holds at most 150)"
    )
    assert alive == reachable(checker)


def test_lockstep_extensions_leave_no_requests_behind():
    """Particles that each extend their context every step (every request after the
    first an extension): what survives is what the checker and the particles hold."""
    import random

    rng = random.Random(0)
    checker = PromptChecker(V, max_len=None, min_remember=8)
    contexts = [[rng.randrange(V) for _ in range(10)] for _ in range(32)]
    before = live_requests()
    latest = [checker.request(c, None) for c in contexts]
    for _ in range(60):
        for i, context in enumerate(contexts):
            context.append(rng.randrange(V))
            latest[i] = checker.request(context, None)
            assert latest[i].parent is not None
    alive = live_requests(before)
    assert alive == reachable(checker, *latest)
    assert len(alive) <= 4 * len(contexts) + 8


def test_refused_prompts_leave_no_requests_behind():
    checker = PromptChecker(V, max_len=None, remember=50)
    checker.request([1, 2], None)
    before = live_requests()
    dicts = generations(checker)
    refs = references(checker, dicts)
    for i in range(2000):
        with pytest.raises((InvalidRequestError, InvalidRequestTypeError)):
            checker.request([1, 2, V + i] if i % 2 else [1, [2], 3], None)
    assert live_requests(before) == set()
    assert references(checker, dicts) == refs
