"""The vLLM backend, :class:`AsyncVirtualLM`.

:mod:`.virtual_lm` is the class, a front over its engine, :mod:`.vllm_engine` (with
:mod:`.logprobs`, its log-probability steps, :mod:`.lora_requests`, its adapters, and
:mod:`.engine_sampling`, vLLM's sampler); :mod:`.runner` steps the engine on its thread;
:mod:`.capture` and :mod:`.forcing` run inside the engine step; :mod:`.session_pool` keeps
requests alive as engine sessions; :mod:`.startup` builds the engine;
:mod:`genlm_backend.llm.row_ring` carries rows from worker processes;
:mod:`.engine_process` runs the engine in a process of its own. :mod:`.internals` is the
seam: the one package that touches vLLM's private parts.
Importing this package imports no part of vllm (which is imported when an engine is built
or wrapped), and works without vllm installed (the class can then be named, not used).
"""

from __future__ import annotations

from .engine_process import start_engine_process
from .logprobs import listing_refusal
from .virtual_lm import DEFAULT_ENGINE_OPTS, AsyncVirtualLM

__all__ = ["AsyncVirtualLM", "DEFAULT_ENGINE_OPTS", "listing_refusal", "start_engine_process"]
