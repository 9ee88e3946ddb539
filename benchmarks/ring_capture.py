"""A logits processor for ``bound_mp.py``: in the engine core's process, the log-softmax of
every row of each step, in fp32, into a ring of row buffers on the device, while a request
marked ``extra_args={RING_KEY: 1}`` is in the batch. That is the engine-side work of a
capture into a ring shared with the frontend: one kernel and one write per step, no per-row
work on the host (a row's place in the ring follows from its session and its step, so only
the token needs to leave the process). Loaded by name (``benchmarks.ring_capture:RingCapture``)
in the engine core's process.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from genlm_backend.llm.vllm_capture import follow_batch

RING_KEY = "ring_capture"
DEPTH = 4  # steps of rows the ring holds


class RingCapture(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        self.ring: torch.Tensor | None = None
        self.marked: dict[int, bool] = {}  # batch rows of marked requests
        self.steps = 0

    def is_argmax_invariant(self) -> bool:
        return False  # (an argmax-invariant processor is skipped for greedy batches)

    def update_state(self, batch_update: Any) -> None:
        if batch_update is not None:
            follow_batch(self.marked, batch_update, _marked)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.marked:
            return logits
        n, vocab = logits.shape
        ring = self.ring
        if ring is None or ring.shape[1] < n or ring.shape[2] != vocab:
            ring = self.ring = torch.empty((DEPTH, max(n, 256), vocab), device=logits.device, dtype=torch.float32)
        torch.log_softmax(logits.float(), dim=-1, out=ring[self.steps % DEPTH, :n])
        self.steps += 1
        return logits


def _marked(params: Any, _output_ids: list[int]) -> bool | None:
    return True if (getattr(params, "extra_args", None) or {}).get(RING_KEY) else None
