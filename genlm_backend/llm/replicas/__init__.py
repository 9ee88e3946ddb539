"""Replicas: one :class:`~genlm_backend.llm.base.AsyncLM` over k engines of the same model,
each on its own GPU (or group of GPUs), for programs with more particles than one engine
serves.

- :mod:`.backend`: :class:`ReplicatedLM`, the model a program awaits. Its own batcher,
  deduplication, output cache, adapters and sync twins are the base class's; a batch is
  split over the replicas and every replica evaluates its share as one batch of its own.
- :mod:`.gathering`: one batch over the replicas: shares started at once, rows (or each
  replica's own errors) put back in order, on one device.
- :mod:`.routing`: :class:`Router`, which replica gets each request: a particle's next
  context, and its resampled children's, where its prefix is cached and its engine session
  lives; then balance; new contexts to the least loaded replica.
- :mod:`.building`: where :meth:`ReplicatedLM.from_name` puts each replica. vLLM's own data
  parallelism is not used: its offline ``LLM`` refuses ``data_parallel_size > 1`` in one
  process (0.32), so every replica is an engine of its own whose model runs in a worker
  process (two engines whose models share this process cannot step side by side).

Nothing here imports vLLM at import time.
"""

from __future__ import annotations

from .backend import ReplicatedLM
from .routing import Router

__all__ = ["ReplicatedLM", "Router"]
