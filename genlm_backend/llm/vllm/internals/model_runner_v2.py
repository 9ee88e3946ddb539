"""Rows and forced tokens on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``, checked against
:data:`V2_CHECKED_VERSIONS`), the runner vLLM 0.26 picks on CUDA unless something it does not
support is asked for, a custom logits processor included.

The engine is started with ``worker_cls=`` :data:`CAPTURE_WORKER` (vLLM's public option naming
the worker class each worker process builds by its qualified name): that class
(:mod:`.capture_worker`) is vLLM's CUDA ``Worker`` that, once the model is loaded, wraps its
model runner's sampler in a :class:`RowSampler`. That sampler is the rows' part of every
engine step:

1. the final rows of tagged requests (not a partial prefill: the runner's host arrays tell)
   go to their sinks (:data:`.row_sinks.SINKS`), before vLLM's sampler runs (it changes the
   logits in place); a sink hands each row to its caller and, where sessions are held, waits
   for the next batch and says which tokens those requests take next;
2. those tokens are the step's sampled tokens: vLLM records them itself (the next step's
   input, the request's output). Where every row of the step is forced, vLLM's sampler does
   not run at all.

What is relied on (0.26.0): ``vllm.v1.worker.gpu_worker.Worker.load_model``; the runner's
``sampler`` (called as ``sampler(logits, input_batch) -> SamplerOutput``,
``add_request(slot, prompt_len, params)`` for each request it adds, every other attribute
read through) and ``device``; ``InputBatch.num_reqs``, ``idx_mapping_np``,
``num_scheduled_tokens``, ``num_computed_prefill_tokens_np``, ``prefill_len_np``,
``num_draft_tokens`` and ``seq_lens``; ``SamplerOutput``. ``tests/llm/test_vllm_runner_v2.py``
checks these names and fails loudly where they move.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from .engine_core import _model_runner
from .row_sinks import CAPTURE_KEY, SINKS, DeviceLists

__all__ = ["CAPTURE_WORKER", "V2_CHECKED_VERSIONS", "RowSampler", "final_rows", "row_sampler",
           "runner_v2_refusal"]

V2_CHECKED_VERSIONS = ("0.26.0",)
CAPTURE_WORKER = f"{__package__}.capture_worker.CaptureWorker"


def runner_v2_refusal(opts: dict) -> str | None:
    """Why an engine started with ``opts`` takes its rows from the logits processor on
    vLLM's V1 runner instead of :class:`RowSampler`, or None where it can take them here: a
    CUDA engine of a checked vLLM, one worker in this process, no speculative decoding, no
    logits processor or worker class of the caller's, no LoRA, and Model Runner V2 not turned
    off."""
    import vllm
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "not a CUDA engine"
    if vllm.__version__ not in V2_CHECKED_VERSIONS:
        return f"vLLM {vllm.__version__} (Model Runner V2 checked on {V2_CHECKED_VERSIONS})"
    for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        if int(opts.get(key) or 1) > 1:
            return f"{key} > 1"
    if opts.get("distributed_executor_backend") not in (None, "uni"):
        return "workers in other processes"
    for key in ("speculative_config", "logits_processors", "enable_lora"):
        if opts.get(key):
            return key
    if opts.get("async_scheduling"):
        return "async scheduling"
    if opts.get("worker_cls", "auto") != "auto":
        return "the caller's worker_cls"
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        return "VLLM_USE_V2_MODEL_RUNNER=0"
    return None


def row_sampler(engine: Any) -> RowSampler | None:
    """The :class:`RowSampler` of an engine started with :data:`CAPTURE_WORKER` whose runner
    is Model Runner V2 (else None: vLLM fell back to its V1 runner)."""
    sampler = getattr(_model_runner(engine), "sampler", None)
    return sampler if isinstance(sampler, RowSampler) else None


class RowSampler:
    """Model Runner V2's sampler, wrapped (see the module)."""

    def __init__(self, base: Any, device: torch.device):
        self.base = base
        self.tags: dict[int, tuple[str, int]] = {}  # request slot -> (sink token, tag)
        self.lists = DeviceLists(device, pin_memory=True)
        self.num_skipped = 0  # steps whose every token was forced: vLLM's sampler did not run

    def __getattr__(self, name: str) -> Any:  # the runner reads the base sampler's states
        return getattr(self.base, name)

    def add_request(self, slot: int, prompt_len: int, params: Any) -> None:
        capture = (getattr(params, "extra_args", None) or {}).get(CAPTURE_KEY)
        if capture is None:
            self.tags.pop(slot, None)
        else:
            self.tags[slot] = (capture[0], int(capture[1]))
        self.base.add_request(slot, prompt_len, params)

    def __call__(self, logits: torch.Tensor, input_batch: Any) -> Any:
        final = final_rows(input_batch, self.tags) if self.tags else {}
        forced: list[tuple[int, int]] = []
        for token, rows in final.items():
            sink = SINKS.get(token)
            if sink is not None:
                forced += sink.hand_over(logits, rows, self.lists)
        if not forced:
            return self.base(logits, input_batch)
        forced.sort()
        if len(forced) == input_batch.num_reqs:  # every row a held session's forced token
            self.num_skipped += 1
            return self._forced_output([t for _, t in forced], input_batch)
        out = self.base(logits, input_batch)
        both = self.lists.put([i for i, _ in forced] + [t for _, t in forced]).clone()
        out.sampled_token_ids[both[: len(forced)], 0] = both[len(forced):]
        return out

    def _forced_output(self, tokens: list[int], input_batch: Any) -> Any:
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        # A copy of its own: vLLM reads the tokens on another stream after this returns.
        sampled = self.lists.put(tokens).clone().view(-1, 1)
        # Every row is a final one with one logit: one token sampled, none rejected.
        num_sampled = input_batch.seq_lens.new_ones(input_batch.num_reqs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None, num_nans=None,
                             num_sampled=num_sampled, num_rejected=torch.zeros_like(num_sampled))


def final_rows(input_batch: Any, tags: dict[int, tuple[str, int]]
               ) -> dict[str, list[tuple[int, int]]]:
    """The final rows of tagged requests in a step, by sink token: ``(row index, tag)`` pairs
    sorted by index. Every scheduled request has one row (no draft tokens); it is final when
    the step completes the request's prefill (a decode row always does)."""
    if input_batch.num_draft_tokens:
        return {}
    n = input_batch.num_reqs
    done = (input_batch.num_computed_prefill_tokens_np[:n] + input_batch.num_scheduled_tokens[:n]
            >= input_batch.prefill_len_np[:n])
    out: dict[str, list[tuple[int, int]]] = {}
    for i in np.flatnonzero(done).tolist():
        entry = tags.get(int(input_batch.idx_mapping_np[i]))
        if entry is not None:
            out.setdefault(entry[0], []).append((i, entry[1]))
    return out
