"""Where the capture inside vLLM's step finds the sinks of this process, and how it moves
small index lists to the device.

Both captures use these: the logits processor of vLLM's V1 model runner
(:mod:`genlm_backend.llm.vllm.capture`) and the sampler of Model Runner V2
(:mod:`.model_runner_v2`). A request's ``SamplingParams.extra_args[CAPTURE_KEY]`` is
``[sink token, tag]``; the sink registered under that token gets the request's rows. Holds no
vLLM object.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["CAPTURE_KEY", "SINKS", "DeviceLists"]

CAPTURE_KEY = "genlm_backend_capture"

# sink token -> sink (a ``capture.CaptureSink``), for as long as its model lives.
SINKS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


class DeviceLists:
    """Small int64 lists to the device through one reused pinned buffer: no allocation, and
    the copy does not wait for the work queued before it (a copy from pageable memory would
    wait for the forward pass). One list at a time: a new one waits for the last copy, and
    overwrites the device tensor the last one returned once the work queued before it ran."""

    def __init__(self, device: torch.device, pin_memory: bool):
        self.device = device
        self.pinned = device.type == "cuda" and pin_memory
        self.host: torch.Tensor | None = None
        self.dev: torch.Tensor | None = None
        self.copied: Any = None  # a CUDA event: the last copy out of ``host`` is done

    def put(self, values: list[int]) -> torch.Tensor:
        if not self.pinned:
            return torch.tensor(values, dtype=torch.int64).to(self.device)
        n = len(values)
        if self.host is None or self.host.shape[0] < n:
            size = max(n, 2 * (0 if self.host is None else self.host.shape[0]), 512)
            self.host = torch.empty(size, dtype=torch.int64, pin_memory=True)
            self.dev = torch.empty(size, dtype=torch.int64, device=self.device)
            self.copied = torch.cuda.Event()
        else:
            self.copied.synchronize()  # the host buffer is free again
        self.host.numpy()[:n] = values
        out = self.dev[:n]
        out.copy_(self.host[:n], non_blocking=True)
        self.copied.record()
        return out
