"""Building the replicas of :meth:`ReplicatedLM.from_name
<genlm_backend.llm.replicas.ReplicatedLM.from_name>`: which GPUs each one gets, and with
which engine options.

vLLM engines: every replica is a :class:`~genlm_backend.llm.replicas.process.ProcessReplica`,
an engine in a process of its own with the caller's options (its model in that process by
default: the fastest route, with held sessions). Engines in one process would take turns:
vLLM keeps a model's forward context in one process-wide variable
(``vllm.forward_context._forward_context``, 0.26 and 0.32), and the engines' scheduling and
bookkeeping would share one interpreter lock. On a GPU, replica ``r`` gets
``tensor_parallel_size * pipeline_parallel_size`` GPUs of its own, its process's only
visible ones (``CUDA_VISIBLE_DEVICES``). One replica is an engine in this process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from ...exceptions import InvalidRequestError
from ..loading import BACKENDS

__all__ = ["BACKENDS", "build_replicas", "device_groups", "visible_ids"]


def device_groups(num_replicas: int, per_replica: int, devices: Sequence[int]) -> list[list[int]]:
    """Consecutive groups of ``per_replica`` of ``devices`` (this process's CUDA indices),
    one group a replica.

    Raises:
        ValueError: fewer devices than ``num_replicas * per_replica``.
    """
    needed = num_replicas * per_replica
    if len(devices) < needed:
        raise ValueError(
            f"{num_replicas} replicas of {per_replica} GPU(s) each need {needed} GPUs; "
            f"{len(devices)} are available ({list(devices)}): pass fewer replicas or devices="
        )
    return [list(devices[r * per_replica : (r + 1) * per_replica]) for r in range(num_replicas)]


def visible_ids(group: Sequence[int], visible: str | None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries of this process's devices ``group``: the
    entries of this process's own ``visible`` (its ``CUDA_VISIBLE_DEVICES``, None if unset)
    at those indices, or the indices themselves."""
    if visible is None or not visible.strip():
        return [str(i) for i in group]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return [entries[i] for i in group]


def build_replicas(
    model_name: str,
    num_replicas: int,
    backend: str,
    engine_opts: dict | None,
    devices: Sequence[int] | None,
    replica_kwargs: dict[str, Any],
) -> tuple[list[Any], str | None]:
    """Builds ``num_replicas`` backends on ``model_name``; returns them and the device that
    rows should reach the caller on (None: where replica 0 puts them). If one build fails,
    those built before it are cleaned up before the error goes on.

    Raises:
        InvalidRequestError: an unknown backend, or options the replicas cannot run with.
        ValueError: not enough GPUs.
    """
    if backend not in BACKENDS:
        raise InvalidRequestError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise InvalidRequestError(f"replicas must be a positive int, got {num_replicas!r}")
    if engine_opts is not None and backend != "vllm":
        raise InvalidRequestError("engine_opts are vLLM's engine options: pass them with backend='vllm'")
    import torch

    on_gpu = torch.cuda.is_available() and backend != "mock"
    if devices is None and on_gpu:
        devices = list(range(torch.cuda.device_count()))
    built: list[Any] = []
    try:
        if backend == "vllm":
            built = _build_vllm(model_name, num_replicas, dict(engine_opts or {}), devices, on_gpu,
                                replica_kwargs, built)
        elif backend == "hf":
            from ..hf import AsyncTransformer

            groups = device_groups(num_replicas, 1, devices) if on_gpu else [None] * num_replicas
            for group in groups:
                kwargs = dict(replica_kwargs)
                if group is not None:
                    hf_opts = dict(kwargs.pop("hf_opts", None) or {})
                    hf_opts.setdefault("device_map", f"cuda:{group[0]}")
                    kwargs["hf_opts"] = hf_opts
                built.append(AsyncTransformer.from_name(model_name, **kwargs))
        else:
            from ..mock import MockAsyncLM

            for _ in range(num_replicas):
                built.append(MockAsyncLM.from_name(model_name, **replica_kwargs))
    except BaseException:
        for lm in built:  # the build's own error is the one to see
            with contextlib.suppress(Exception):
                lm.cleanup()
        raise
    # Rows of vLLM replicas with workers come on their worker's GPU (one replica's, on the
    # device its engine picks); an HF replica's on the GPU given here.
    placed = on_gpu and devices and (backend == "hf" or num_replicas > 1)
    return built, f"cuda:{devices[0]}" if placed else None


def _build_vllm(model_name: str, num_replicas: int, opts: dict, devices: Sequence[int] | None, on_gpu: bool,
                replica_kwargs: dict[str, Any], built: list[Any]) -> list[Any]:
    """The vLLM replicas (appended to ``built`` as they start, so a failure cleans them up):
    one engine in this process, or one process per replica, started side by side."""
    if num_replicas == 1:
        from ..vllm import AsyncVirtualLM

        built.append(AsyncVirtualLM.from_name(model_name, engine_opts=opts, **replica_kwargs))
        return built
    from .process import start_replicas

    if on_gpu:
        per_replica = int(opts.get("tensor_parallel_size") or 1) * int(opts.get("pipeline_parallel_size") or 1)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        placements = [visible_ids(g, visible) for g in device_groups(num_replicas, per_replica, devices)]
        home = f"cuda:{devices[0]}"
    else:
        placements, home = [None] * num_replicas, None
    built.extend(start_replicas("vllm", model_name, {"engine_opts": opts, **replica_kwargs}, placements, home))
    return built
