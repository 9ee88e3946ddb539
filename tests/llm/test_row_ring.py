"""The row ring that an engine worker process shares with the engine's process
(:mod:`genlm_backend.llm.row_ring`): where a step's rows go, that the steps a worker may run
while the engine's process still reads one never write over it, and that rows written in
another process read back exactly (a CPU ring here; a CUDA one where there is a GPU)."""

from __future__ import annotations

import multiprocessing
import os
import random

import pytest
import torch

from genlm_backend.llm.row_ring import READ_LAG, RowRing, open_ring


def test_a_step_takes_consecutive_slots_and_restarts_at_zero_when_they_do_not_fit():
    ring = RowRing(torch.zeros(12, 3), max_rows=4)
    assert [ring.claim(n) for n in (4, 3, 4)] == [0, 4, 7]
    assert ring.claim(2) == 0  # 11 + 2 > 12
    assert ring.claim(5) is None  # more rows than a step may have: the caller sends them otherwise
    assert ring.claim(4) == 2


def claimed(num_slots: int, max_rows: int, seed: int, steps: int = 3000) -> list[set[int]]:
    """The slots of ``steps`` steps of random sizes (1 to ``max_rows`` rows) on a ring."""
    ring, rng = RowRing(torch.zeros(num_slots, 1), max_rows), random.Random(seed)
    return [set(range(start, start + n)) for n in (rng.randint(1, max_rows) for _ in range(steps))
            for start in [ring.claim(n)]]


def overwritten(steps: list[set[int]], depth: int) -> bool:
    """Some step's slots are written again within the ``depth`` steps after it."""
    return any(
        steps[k] & set().union(*steps[k + 1 : k + 1 + depth]) for k in range(len(steps) - depth)
    )


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_the_steps_run_while_one_is_read_never_reach_its_slots(depth):
    """``depth`` steps run in the worker while one is read, and ``READ_LAG`` more before this
    process makes sure its copy is done."""
    max_rows, ahead = 7, depth + READ_LAG
    made = RowRing.create(max_rows, depth, 1, "cpu")
    os.unlink(made.path)  # (nobody maps it: open_ring would remove it)
    assert made.shape == ((ahead + 2) * max_rows, 1)
    assert not overwritten(claimed((ahead + 2) * max_rows, max_rows, seed=depth), ahead)
    # One step's worth fewer, and random steps do write over a step still being read.
    assert overwritten(claimed((ahead + 1) * max_rows, max_rows, seed=depth), ahead)


def test_rows_read_before_the_next_step_need_only_a_ring_of_depth_0():
    """Read at once (``lag=0``, the next step waits for the read): ``2 * max_rows`` slots,
    and no step's rows reach the slots of the step read just before it."""
    max_rows = 7
    made = RowRing.create(max_rows, 0, 1, "cpu", lag=0)
    os.unlink(made.path)
    assert made.shape == (2 * max_rows, 1) and made.lag == 0
    ring, rng = RowRing(torch.zeros(2 * max_rows, 1), max_rows, lag=0), random.Random(5)
    for step in range(2000):  # write a step, read it back whole, then the next step
        n = rng.randint(1, max_rows)
        start = ring.claim(n)
        values = torch.arange(n, dtype=torch.float32).unsqueeze(1) + 100 * step
        ring.slots(start, n).copy_(values)
        assert start + n <= 2 * max_rows and torch.equal(ring.read(start, n), values)


def _write_in_child(handle, start, rows):
    ring = open_ring(handle)
    ring.slots(start, rows.shape[0]).copy_(rows.to(ring.rows.device))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a CUDA ring needs a GPU"))])
def test_rows_written_in_another_process_read_back_exactly(device):
    """The worker's side is the other way round (it makes the ring, this process maps it);
    a ring mapped from a handle and one made here are the same object either way."""
    ring = RowRing.create(max_rows=4, depth=1, width=5, device=device)
    assert ring.shape == ((1 + READ_LAG + 2) * 4, 5)
    rows = torch.randn(3, 5)
    start = ring.claim(3)
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=_write_in_child, args=(ring.handle(), start, rows))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    read = ring.read(start, 3)
    assert torch.equal(read.cpu(), rows)
    ring.slots(start, 3).zero_()  # a copy: the ring may be written over once read returns
    assert torch.equal(read.cpu(), rows)


def test_a_cuda_ring_is_opened_on_the_device_with_its_uuid(monkeypatch):
    """A worker started with another ``CUDA_VISIBLE_DEVICES`` may call its GPU ``cuda:0``
    where this process, which sees every GPU, calls it ``cuda:1``. The handle's UUID says
    which one it is."""
    from genlm_backend.llm import row_ring
    from genlm_backend.llm.row_ring import local_device_index

    uuids = ["GPU-aa", "GPU-bb"]
    assert local_device_index("GPU-bb", 0, uuids) == 1
    assert local_device_index("GPU-aa", 0, uuids) == 0
    assert local_device_index(None, 1, uuids) == 1  # no UUID: the index as given
    assert local_device_index("GPU-cc", 0, uuids) == 0  # not a device of this process

    seen = []

    def rebuild(tensor_cls, storage_device, storage_handle):  # torch's names, fewer of them
        seen.append(storage_device)
        return torch.zeros(8, 3)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(row_ring, "device_uuid", lambda index: uuids[index])
    ring = open_ring(("cuda", rebuild, (None, 0, b"handle"), 4, "GPU-bb"))
    assert seen == [1] and ring.shape == (8, 3) and ring.max_rows == 4
    open_ring(("cuda", rebuild, (None, 0, b"handle"), 4))  # a handle without a UUID
    assert seen == [1, 0]
