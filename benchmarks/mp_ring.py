"""The engine-core side of ``proto_mp_rows.py``: a logits processor that writes the fp32
log-softmax of every marked request's rows into a ring shared with the process that added
the requests. The ring has a lane per request (``extra_args={LANE_KEY: lane}``) and a slot per
row: a row's place follows from its lane and its index in the request's output, so nothing
but the token has to travel with vLLM's outputs.

Flow control: before a step's write, the processor waits until the other process has granted
the rows it would write. ``tickets`` (shared memory, one int64) holds how many rows of each
request may be written (the other process counts from 0 for each batch of requests it adds);
while the step would write beyond that, the engine's step waits there, sleeping between
looks so that the process's other threads run.

Loaded by name in the engine core's process (``benchmarks.mp_ring:LaneRing``); told where
to publish the ring and which tickets to wait on by ``$GENLM_PROTO_RING``
(``path:lanes:depth:tickets``). On CUDA the ring is shared by CUDA IPC (``ForkingPickler``),
on the CPU through named shared memory.
"""

from __future__ import annotations

import os
import pickle
import time
from multiprocessing import shared_memory
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from vllm.v1.sample.logits_processor import LogitsProcessor

from genlm_backend.llm.vllm_capture import follow_batch

RING_ENV = "GENLM_PROTO_RING"
LANE_KEY = "proto_lane"


def open_ring(path: str) -> tuple[torch.Tensor, Any]:
    """In the other process: the ring the engine core published at ``path`` (and what keeps
    its memory mapped)."""
    with open(path, "rb") as f:
        kind, payload = pickle.load(f)
    if kind == "cuda":
        return pickle.loads(payload), None
    name, shape = payload
    shm = shared_memory.SharedMemory(name=name)
    return torch.frombuffer(shm.buf, dtype=torch.float32).view(shape), shm


class LaneRing(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        path, lanes, depth, tickets = os.environ[RING_ENV].rsplit(":", 3)
        self._tickets_shm = shared_memory.SharedMemory(name=tickets)
        self.tickets = torch.frombuffer(self._tickets_shm.buf, dtype=torch.int64)  # [rows granted per lane]
        shape = (int(lanes), int(depth), int(vllm_config.model_config.get_vocab_size()))
        if device.type == "cuda":
            self.ring = torch.empty(shape, device=device, dtype=torch.float32)
            published = ("cuda", bytes(ForkingPickler.dumps(self.ring)))
        else:
            size = shape[0] * shape[1] * shape[2] * 4
            self._shm = shared_memory.SharedMemory(create=True, size=size)
            self.ring = torch.frombuffer(self._shm.buf, dtype=torch.float32).view(shape)
            published = ("shm", (self._shm.name, shape))
        with open(path + ".tmp", "wb") as f:
            pickle.dump(published, f)
        os.replace(path + ".tmp", path)
        self.device, self.pin = device, is_pin_memory
        self.lane_of: dict[int, int] = {}  # batch row -> lane
        # Rows written per lane since its request was added, on the device: a step's write
        # needs no copy from the host (a synchronous one would stall the engine's pipeline).
        self.written = torch.zeros(shape[0], dtype=torch.long, device=device)
        self.written_here = [0] * shape[0]  # the same on the host, for the flow control
        self.reset: list[int] = []  # lanes whose request was added since the last step
        self.batch: tuple[torch.Tensor, torch.Tensor] | None = None  # (batch rows, lanes) on the device

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Any) -> None:
        if batch_update is not None:
            self.batch = None
            follow_batch(self.lane_of, batch_update, self._lane)

    def _lane(self, params: Any, _output_ids: list[int]) -> int | None:
        """An added request's lane (its rows start again at slot 0), or None."""
        lane = (getattr(params, "extra_args", None) or {}).get(LANE_KEY)
        if lane is None:
            return None
        self.reset.append(int(lane))
        self.written_here[int(lane)] = 0
        return int(lane)

    def _on_device(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, pin_memory=self.pin).to(self.device, non_blocking=True)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.lane_of:
            return logits
        written, tickets = self.written_here, self.tickets.numpy()
        lanes_here = list(self.lane_of.values())
        need = max(written[lane] for lane in lanes_here) + 1
        while tickets[0] < need:
            time.sleep(0)  # (releases the GIL: the process's other threads run)
        for lane in lanes_here:
            written[lane] += 1
        if self.reset:
            self.written[self._on_device(self.reset)] = 0
            self.reset = []
        if self.batch is None:
            rows, lanes = zip(*sorted(self.lane_of.items()))
            self.batch = (self._on_device(list(rows)), self._on_device(list(lanes)))
        rows, lanes = self.batch
        slots = self.written[lanes] % self.ring.shape[1]
        self.ring[lanes, slots] = torch.log_softmax(logits[rows].float(), dim=-1)
        self.written[lanes] += 1
        return logits
