"""Engines for the engine-process tests, built in the child by their module and name."""

from __future__ import annotations

import os
import threading

import torch

from genlm_backend.llm.engine import ThreadedEngine


class LinkEngine(ThreadedEngine):
    """Rows that start ``[len(token_ids), has a parent, the parent's ids are the prompt less
    its last id]`` (then zeros): what the child's requests look like."""

    vocab_size = 64

    def __init__(self):
        super().__init__("link-engine")

    def evaluate_batch(self, requests):
        out = []
        for r in requests:
            parent = r.parent
            ok = parent is not None and parent.token_ids == r.token_ids[:-1]
            row = torch.zeros(self.vocab_size)
            row[:3] = torch.tensor([len(r.token_ids), parent is not None, ok])
            out.append(row)
        return out


class StuckEngine(ThreadedEngine):
    """Rows of zeros, except that a prompt starting with 7 blocks its batch for a minute; a
    prompt starting with 8 gets an error of its own; 9 fails the whole batch."""

    vocab_size = 16

    def __init__(self):
        super().__init__("stuck-engine")
        self.release = threading.Event()

    def evaluate_batch(self, requests):
        if any(r.token_ids[0] == 9 for r in requests):
            raise ValueError("a batch with 9 in it")
        if any(r.token_ids[0] == 7 for r in requests):
            self.release.wait(60.0)
        return [ValueError(f"no row for {r.token_ids}") if r.token_ids[0] == 8
                else torch.zeros(16) for r in requests]


def refusing_engine(reason: str):
    raise RuntimeError(f"cannot build: {reason}")


def pid_engine():
    """A mock engine whose rows say which process made them (row[0] = the pid's low bits)."""

    class PidEngine(ThreadedEngine):
        vocab_size = 4

        def __init__(self):
            super().__init__("pid-engine")

        def evaluate_batch(self, requests):
            return [torch.tensor([os.getpid() % 1000, 0, 0, 0], dtype=torch.float32)
                    for _ in requests]

    return PidEngine()
