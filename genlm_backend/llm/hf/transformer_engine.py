"""The engine of :class:`~genlm_backend.llm.hf.AsyncTransformer`: batches of prompts run on
its own thread, each prompt resumed from the longest prefix whose key/value states the trie
(:mod:`.kvtrie`) holds, the new tokens of all prompts in as few padded forward passes as
possible (:mod:`.forward`)."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch

from ...exceptions import EngineError, InvalidRequestError
from ..engine import ThreadedEngine
from ..prompts import LogprobsRequest
from .forward import Step, make_step, plan_chunks, run_chunk, shared_prefixes
from .kv_cache import accepts_logits_to_keep
from .kvtrie import KVTrie
from .peft_adapters import PeftAdapters

__all__ = ["TransformerEngine"]


class TransformerEngine(PeftAdapters, ThreadedEngine):
    """Evaluates batches of log-probability requests with a transformers causal LM.

    Args:
        hf_model: the model, already on its device (put in eval mode here).
        max_kv_cache_bytes: bound on the bytes of cached key/value tensors.
        max_forward_tokens: the most new tokens (padding included) of one grouped pass.
    """

    def __init__(self, hf_model: Any, max_kv_cache_bytes: int, max_forward_tokens: int):
        self.model = hf_model.eval()
        self.device = hf_model.get_input_embeddings().weight.device
        output = hf_model.get_output_embeddings()
        config = (
            hf_model.config.get_text_config()
            if hasattr(hf_model.config, "get_text_config")
            else hf_model.config
        )
        self.vocab_size = (
            int(output.weight.shape[0]) if output is not None else int(config.vocab_size)
        )
        limit = getattr(config, "max_position_embeddings", None)
        self.max_prompt_len = int(limit) if isinstance(limit, int) and limit > 0 else None
        self._keeps_logits = accepts_logits_to_keep(hf_model)
        self.max_forward_tokens = int(max_forward_tokens)
        self.kv = KVTrie(max_kv_cache_bytes)
        self.lock = threading.RLock()  # the trie and the model's adapter state
        self._has_adapters = False
        self._warned_oversized = False
        self.num_forward_passes = 0
        self.num_forward_tokens = 0
        self.num_reused_tokens = 0
        super().__init__("genlm-AsyncTransformer")

    def evaluate_batch(self, requests: list[LogprobsRequest]) -> list[Any]:
        results: list[Any] = [None] * len(requests)
        by_adapter: dict[str | None, list[int]] = {}
        for i, request in enumerate(requests):
            by_adapter.setdefault(request.lora_name, []).append(i)
        with self.lock, torch.no_grad():
            try:
                for adapter, slots in by_adapter.items():
                    removed = self._removed_adapter(adapter)
                    if removed is not None:  # since these requests were queued: they fail alone
                        for i in slots:
                            results[i] = removed
                        continue
                    with self.adapter(adapter):
                        self._run(
                            adapter,
                            [(i, requests[i].token_ids) for i in slots],
                            results,
                            wants_logits=True,
                        )
            finally:
                self._evict()
        return results

    def cache_kv(self, request: LogprobsRequest) -> None:
        """On the engine's thread: computes and keeps the states of ``request``'s prompt."""
        with self.lock, torch.no_grad(), self.adapter(request.lora_name):
            results: list[Any] = [None]
            try:
                self._run(request.lora_name, [(0, request.token_ids)], results, wants_logits=False)
            finally:
                self._evict()
            if isinstance(results[0], BaseException):
                raise results[0]

    def uncached_row(self, request: LogprobsRequest) -> torch.Tensor:
        """On the engine's thread: one plain forward pass over the whole prompt."""
        with self.lock, torch.no_grad(), self.adapter(request.lora_name):
            kwargs = {"logits_to_keep": 1} if self._keeps_logits else {}
            ids = torch.tensor([request.token_ids], device=self.device)
            logits = self.model(input_ids=ids, use_cache=False, **kwargs).logits
            return logits[0, -1].float().log_softmax(dim=-1)

    def stats(self) -> dict[str, Any]:
        """Forward passes, tokens run, tokens reused and the trie's size."""
        with self.lock:
            return {
                "num_forward_passes": self.num_forward_passes,
                "num_forward_tokens": self.num_forward_tokens,
                "num_reused_tokens": self.num_reused_tokens,
                "kv_cache_bytes": self.kv.num_bytes,
                "kv_cache_blocks": self.kv.num_blocks,
                "kv_evicted_blocks": self.kv.num_evicted_blocks,
                "max_kv_cache_bytes": self.kv.max_bytes,
            }

    # ---- evaluation -------------------------------------------------------------------

    def _run(
        self,
        adapter: str | None,
        prompts: list[tuple[int, tuple[int, ...]]],
        results: list[Any],
        *,
        wants_logits: bool,
    ) -> None:
        """Evaluates ``prompts`` (slot, token ids) of one adapter into ``results[slot]``.

        A forward pass that fails is retried prompt by prompt, so one failing prompt (or a
        batch too large for memory) fails only its own callers.
        """
        steps = [
            make_step(self.kv, adapter, slot, ids, wants_logits=wants_logits)
            for slot, ids in prompts
        ]
        prefixes = shared_prefixes(steps)
        if prefixes:  # run prefixes shared within the batch once, then resume every prompt
            self._run_steps(
                adapter,
                [make_step(self.kv, adapter, -1, p, wants_logits=False) for p in prefixes],
                [],
                wants_logits=False,
            )
            steps = [
                make_step(self.kv, adapter, slot, ids, wants_logits=wants_logits)
                for slot, ids in prompts
            ]
        self._run_steps(adapter, steps, results, wants_logits=wants_logits)

    def _run_steps(
        self, adapter: str | None, steps: list[Step], results: list[Any], *, wants_logits: bool
    ) -> None:
        chunks = plan_chunks(
            steps,
            vocab_size=self.vocab_size,
            max_forward_tokens=self.max_forward_tokens,
            keeps_logits=self._keeps_logits,
        )
        for chunk in chunks:
            try:
                self._run_chunk(adapter, chunk, results)
            except Exception as exc:  # noqa: BLE001 - routed to the callers below
                if len(chunk) == 1:
                    _store(results, chunk[0].slot, _engine_error(exc))
                    continue
                for step in chunk:
                    try:
                        retry = make_step(
                            self.kv, adapter, step.slot, step.token_ids, wants_logits=wants_logits
                        )
                        if retry.num_new > 0:
                            self._run_chunk(adapter, [retry], results)
                    except Exception as exc_one:  # noqa: BLE001 - this prompt's own failure
                        _store(results, step.slot, _engine_error(exc_one))

    def _run_chunk(self, adapter: str | None, chunk: list[Step], results: list[Any]) -> None:
        rows = run_chunk(
            self.model,
            self.kv,
            adapter,
            chunk,
            device=self.device,
            keeps_logits=self._keeps_logits,
        )
        self.num_forward_passes += 1
        self.num_forward_tokens += sum(s.num_new for s in chunk)
        self.num_reused_tokens += sum(s.num_cached for s in chunk)
        for step, row in rows:
            _store(results, step.slot, row)

    def _evict(self) -> None:
        num_oversized = self.kv.num_oversized_blocks
        self.kv.evict()
        if num_oversized and not self._warned_oversized:
            self._warned_oversized = True
            warnings.warn(
                "the key/value states of one forward pass exceeded "
                f"max_kv_cache_bytes={self.kv.max_bytes} "
                "and were not kept: prompts that extend them recompute everything. Raise "
                "max_kv_cache_bytes (or lower batch_size).",
                RuntimeWarning,
                stacklevel=2,
            )

    def close(self) -> None:
        with self.lock:
            self.kv.clear()
            self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        super().close()


def _store(results: list[Any], slot: int, value: Any) -> None:
    if slot >= 0:  # slot -1: a shared prefix run only for its states
        results[slot] = value


def _engine_error(exc: BaseException) -> BaseException:
    if isinstance(exc, (EngineError, InvalidRequestError)):
        return exc
    error = EngineError(f"the model failed on this prompt: {exc!r}")
    error.__cause__ = exc
    return error
