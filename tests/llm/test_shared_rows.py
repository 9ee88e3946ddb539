"""The ring of rows shared between an engine process and the program's process
(SharedRows): slots are never written over before they are copied, and a batch that fits
in the ring is never refused once every earlier row is copied."""

from __future__ import annotations

import os
import random

import torch

from genlm_backend.llm.engine_process.channel import SharedRows


def test_claims_never_overlap_rows_not_yet_copied_and_always_fit_an_empty_ring():
    rng = random.Random(0)
    ring = SharedRows.create(64, 4, torch.device("cpu"))
    description, fds = ring.handle()
    reader = SharedRows.open(description, [os.dup(fds[0])])  # as the socket hands it over
    outstanding: list[tuple[int, int, int]] = []  # (start, count, position) written
    for _ in range(3000):
        count = rng.randrange(1, 65)
        claimed = ring.claim(count)
        if claimed is None:
            assert outstanding, "a batch that fits was refused by an empty ring"
            start, n, position = outstanding.pop(0)
            reader.copy_out(start, n, position)
            continue
        start, position = claimed
        assert 0 <= start and start + count <= 64
        taken = set(range(start, start + count))
        for s, n, _ in outstanding:
            assert not taken & set(range(s, s + n)), "wrote over rows not copied yet"
        ring.rows[start : start + count] = float(position)
        outstanding.append((start, count, position))
        if rng.random() < 0.5:  # the reader copies the oldest batch, and sees what was written
            s, n, p = outstanding.pop(0)
            assert torch.equal(reader.copy_out(s, n, p), torch.full((n, 4), float(p)))
    reader.close()
    ring.close()
