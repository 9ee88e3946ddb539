"""SharedCore: threads pinned to one core while free sessions run, and given back after.

The reference is the kernel's own view of each thread (``os.sched_getaffinity`` by thread
id). The engine-level test (``test_vllm_workers.py``) checks the same around a real run.
"""

from __future__ import annotations

import os
import threading

import pytest

from genlm_backend.llm import core_sharing
from genlm_backend.llm.core_sharing import SharedCore

pytestmark = pytest.mark.skipif(not core_sharing.available(), reason="pins threads one by one: Linux only")


def in_thread(fn):
    """Runs ``fn`` in a new thread; returns (its result, the thread's native id)."""
    out = {}

    def run():
        out["tid"] = threading.get_native_id()
        out["result"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["result"], out["tid"]


def test_joined_threads_share_the_first_ones_core_and_get_their_cores_back():
    before = os.sched_getaffinity(0)
    sharing = SharedCore()
    try:
        sharing.join()
        mine = os.sched_getaffinity(0)
        assert len(mine) == 1 and mine == {sharing.core} and sharing.core in before
        parked, done = threading.Event(), threading.Event()
        seen = {}

        def other():
            seen["before"] = os.sched_getaffinity(0)  # (a new thread inherits the pinned mask)
            sharing.join()
            seen["pinned"] = os.sched_getaffinity(0)
            seen["tid"] = threading.get_native_id()
            parked.set()
            done.wait(10)

        thread = threading.Thread(target=other)
        thread.start()
        assert parked.wait(10)
        assert seen["pinned"] == mine and seen["tid"] in sharing
        sharing.release()
        assert os.sched_getaffinity(0) == before  # the joiner's cores, from before it joined
        assert os.sched_getaffinity(seen["tid"]) == seen["before"]
        done.set()
        thread.join()
    finally:
        os.sched_setaffinity(0, before)
    assert sharing.core is None and threading.get_native_id() not in sharing


def test_joining_twice_keeps_the_cores_from_before_the_first_time():
    def twice():
        before = os.sched_getaffinity(0)
        sharing = SharedCore()
        sharing.join()
        sharing.join()
        sharing.release()
        return before, os.sched_getaffinity(0)

    (before, after), _ = in_thread(twice)
    assert before == after


def test_releasing_a_thread_that_ended_is_harmless():
    sharing = SharedCore()
    _, tid = in_thread(sharing.join)
    assert tid in sharing
    sharing.release()  # that thread is gone: nothing to give back
    assert tid not in sharing


def test_after_a_release_the_next_joiner_chooses_the_core_again():
    """The shared core is where the first joiner runs, and is chosen anew after a release
    (the loop's thread may run elsewhere by the next run)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")

    def run():
        sharing = SharedCore()
        os.sched_setaffinity(0, {cores[0]})
        sharing.join()
        first = sharing.core
        sharing.release()
        os.sched_setaffinity(0, {cores[1]})
        sharing.join()
        return first, sharing.core

    (first, second), _ = in_thread(run)
    assert (first, second) == (cores[0], cores[1])


def test_a_refused_pin_leaves_the_thread_as_it_was(monkeypatch):
    """The system may refuse a core (it left the process's CPU set): the thread keeps its
    cores, and nothing is raised at the request that happened to join."""
    def refuse(pid, cores):
        raise OSError(22, "Invalid argument")

    def run():
        before = os.sched_getaffinity(0)
        sharing = SharedCore()
        monkeypatch.setattr(os, "sched_setaffinity", refuse)
        sharing.join()
        monkeypatch.undo()
        return before, os.sched_getaffinity(0), threading.get_native_id() in sharing

    (before, after, joined), _ = in_thread(run)
    assert before == after and not joined
