"""LoRA on vLLM engines: the GPU kernels' dtype limit, and the fix that keeps adapters off
base-model rows on CPU engines (see :mod:`genlm_backend.llm.vllm.internals`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .engine_core import CHECKED_VERSIONS, _model_runner
from .installed import installed_on

__all__ = ["install_lora_base_rows", "lora_refusal"]

def lora_refusal(engine: Any) -> str | None:
    """Why adapters cannot run on this engine, or None.

    vLLM's CUDA LoRA kernels take fp16/bf16 weights only (``lora/ops/triton_ops``:
    ``assert weight.dtype in [torch.float16, torch.bfloat16]``, 0.26 and 0.32): an fp32 model
    on a GPU would fail inside an engine step, for the whole batch.
    """
    from vllm.platforms import current_platform

    dtype = engine.vllm_config.model_config.dtype
    if dtype == torch.float32 and current_platform.is_cuda_alike():
        return ("vLLM's GPU LoRA kernels support float16 and bfloat16 models only; this engine "
                "runs float32: start it with engine_opts={'dtype': 'bfloat16'} to use adapters")
    return None


# The CPU punica wrapper's calls that apply adapters per token (``token_lora_indices``).
_TOKEN_LORA_CALLS = ("_shrink_prefill", "_shrink_decode", "_expand_prefill", "_expand_decode",
                     "_expand_slice_prefill", "_expand_slice_decode")


def install_lora_base_rows(engine: Any) -> str | None:
    """Keeps adapters off the base-model rows of batches that mix adapters (CPU engines).

    vLLM marks a token without adapter by the LoRA index -1 ("no lora should be applied",
    ``PunicaWrapperBase.token_lora_indices``). The Triton kernels skip such tokens; the
    PyTorch ops of ``PunicaWrapperCPU`` (``lora/ops/torch_ops/lora_ops.py``, 0.32:
    ``lora_b_weights[lora_indices_tensor]``) index the stacked adapter weights with it, so
    once the last of the ``max_loras`` slots holds an adapter, every base-model token in a
    step with adapter tokens gets that adapter (vLLM PR 48421, open). Here each of the
    wrapper's per-token calls (``_shrink_*``, ``_expand_*``, ``add_lora_logits``) leaves the
    rows of -1 tokens as they were, as the Triton kernels do; other rows are computed as
    before. Patches this engine's wrappers (the model manager's
    ``punica_wrapper_mapping``), once, in this process or in each worker process; call on
    the engine thread. Returns why base-model rows cannot be made right (a CPU engine whose
    LoRA manager lacks these), or None (done, or not needed: GPU kernels)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    runner = _model_runner(engine)
    if runner is not None:
        done = _keep_base_rows_in(runner)
    else:  # the model runs in worker processes: patch each of them
        done = all(engine.collective_rpc(_keep_base_rows_in_worker))
    if done:
        return None
    return ("vLLM's CPU LoRA ops apply the last adapter slot to base-model tokens, and this "
            "engine's LoRA manager differs from the checked versions "
            f"{CHECKED_VERSIONS}: base-model rows batched with adapter rows would be wrong")


def _keep_base_rows_in_worker(worker: Any) -> bool:
    """:func:`_keep_base_rows_in` in a worker process (through ``collective_rpc``)."""
    return _keep_base_rows_in(getattr(worker, "model_runner", None))


def _keep_base_rows_in(runner: Any) -> bool:
    """Patches the CPU LoRA wrappers of ``runner`` (see :func:`install_lora_base_rows`);
    False where its LoRA manager is not where the checked versions keep it."""
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    wrappers = getattr(manager, "punica_wrapper_mapping", None)
    if not isinstance(wrappers, dict) or not wrappers:
        return False
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    for wrapper in wrappers.values():
        if not isinstance(wrapper, PunicaWrapperCPU) or installed_on(wrapper).get("base_rows"):
            continue
        for name in _TOKEN_LORA_CALLS:
            setattr(wrapper, name, _keep_base_rows(
                getattr(wrapper, name), lambda w=wrapper: w.token_lora_indices))
        wrapper.add_lora_logits = _keep_base_rows(
            wrapper.add_lora_logits, lambda w=wrapper: w.sampler_indices)
        installed_on(wrapper)["base_rows"] = True
    return True


def _keep_base_rows(
    call: Callable[..., Any], indices_of: Callable[[], torch.Tensor]
) -> Callable[..., Any]:
    """``call(y, ...)`` that leaves the rows of ``y`` whose LoRA index is -1 as they were."""

    def run(y: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        base = indices_of() < 0
        if not bool(base.any()):
            return call(y, *args, **kwargs)
        if bool(base.all()):
            # no adapter token: nothing to add (an all -1 batch would get the last slot)
            return None
        rows = y.view(-1, y.shape[-1])
        index = base[: rows.shape[0]].nonzero().squeeze(1)
        kept = rows.index_select(0, index)
        out = call(y, *args, **kwargs)
        rows.index_copy_(0, index, kept)
        return out

    return run
