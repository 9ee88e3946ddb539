"""`AsyncTransformer`: the Hugging Face transformers backend, with key/value reuse across prompts.

Requests are auto-batched by the shared batcher of :class:`~genlm_backend.llm.base.AsyncLM`.
Each batch is evaluated on the model's engine thread: every prompt resumes from the longest
prefix whose key/value states are cached in a token trie (:mod:`genlm_backend.llm.hf.kvtrie`),
the remaining tokens of all prompts run in as few padded forward passes as possible
(:mod:`genlm_backend.llm.hf.forward`), and the new states go back into the trie. Memory
for those states is bounded (see ``max_kv_cache_bytes``), with least-recently-used eviction.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...exceptions import EngineError, InvalidRequestError
from ..base import AsyncLM, LogprobsRequest, stops_what_it_started
from .forward import Step, make_step, plan_chunks, run_chunk, shared_prefixes
from .kv_cache import accepts_logits_to_keep
from .kvtrie import KVTrie
from .peft_adapters import AdapterMixin

__all__ = ["AsyncTransformer"]

DEFAULT_CPU_KV_BYTES = 2 << 30
DEFAULT_CUDA_KV_FRACTION = 0.25


class AsyncTransformer(AdapterMixin, AsyncLM):
    """A Hugging Face causal LM behind the :class:`AsyncLM` contract, reusing key/value states.

    Log-probabilities are the float32 log-softmax of the model's logits over its whole output
    vocabulary (``V = vocab_size``), on the model's device, whatever the model's dtype. They
    equal those of an uncached forward pass of the same prompt alone up to floating-point
    reordering: within 1e-4 for a float32 model (the default without CUDA); a bfloat16
    model's rows can move by tenths of a nat with the batch (see ``from_name``).

    Key/value reuse: the states of every prompt evaluated are kept in a trie of token
    prefixes, so a prompt that extends a cached one (a particle one token further, a shared
    system prompt) runs only its new tokens. The states are kept in *blocks*, one per forward
    pass; their total size is bounded by ``max_kv_cache_bytes`` and the least recently used
    blocks are evicted after each batch. Each adapter (LoRA) has its own trie.

    Args:
        hf_model: a transformers causal LM (``AutoModelForCausalLM``), already on its device.
        hf_tokenizer: its Hugging Face tokenizer (:attr:`tokenizer`; ``byte_vocab`` and
            ``str_vocab`` are decoded from it on first use).
        batch_size: the most distinct prompts in one batch.
        timeout: seconds after the first queued prompt before its batch runs at the latest.
        max_kv_cache_bytes: bound on the bytes of cached key/value tensors (keys and values of
            all layers, padding included). None: 25% of the GPU's memory for a model on CUDA,
            2 GiB otherwise. 0 keeps nothing between batches (results are unchanged, only
            slower). A single forward pass whose states exceed the bound is not kept, and a
            warning says so.
        max_forward_tokens: the most new tokens (padding included) one forward pass runs
            when several prompts are grouped; a longer single prompt still runs whole.
        **kwargs: ``cache_size``, ``cache_opts``, ``flush`` of :class:`AsyncLM` (the output
            cache, off by default, keeps whole log-probability rows per prompt and adapter).

    Raises:
        TypeError: ``hf_tokenizer`` is None.
    """

    @stops_what_it_started
    def __init__(
        self,
        hf_model: Any,
        hf_tokenizer: Any,
        batch_size: int = 20,
        timeout: float = 0.02,
        *,
        max_kv_cache_bytes: int | None = None,
        max_forward_tokens: int = 8192,
        **kwargs: Any,
    ):
        if hf_tokenizer is None:
            raise TypeError("hf_tokenizer is required: the model's Hugging Face tokenizer")
        super().__init__(hf_tokenizer, batch_size=batch_size, timeout=timeout, **kwargs)
        self.model = hf_model.eval()
        self.device = hf_model.get_input_embeddings().weight.device
        output = hf_model.get_output_embeddings()
        config = (
            hf_model.config.get_text_config()
            if hasattr(hf_model.config, "get_text_config")
            else hf_model.config
        )
        self._vocab_size = (
            int(output.weight.shape[0]) if output is not None else int(config.vocab_size)
        )
        limit = getattr(config, "max_position_embeddings", None)
        self._max_prompt_len = int(limit) if isinstance(limit, int) and limit > 0 else None
        self._keeps_logits = accepts_logits_to_keep(hf_model)
        if max_kv_cache_bytes is None:
            max_kv_cache_bytes = _default_kv_bytes(self.device)
        self.max_forward_tokens = int(max_forward_tokens)
        self._kv = KVTrie(max_kv_cache_bytes)
        self._lock = threading.RLock()  # the trie and the model's adapter state
        self._has_adapters = False
        self._warned_oversized = False
        self.num_forward_passes = 0
        self.num_forward_tokens = 0
        self.num_reused_tokens = 0

    @classmethod
    def from_name(
        cls,
        model_id: str,
        bitsandbytes_opts: dict | None = None,
        hf_opts: dict | None = None,
        **kwargs: Any,
    ) -> AsyncTransformer:
        """Loads a model and its tokenizer with transformers.

        Args:
            model_id: a local folder, a local ``.gguf`` file (loaded through transformers'
                GGUF support), or a Hugging Face model id. Local paths never touch the network.
            bitsandbytes_opts: keyword arguments of ``transformers.BitsAndBytesConfig``
                (quantized loading; needs bitsandbytes and a GPU).
            hf_opts: keyword arguments of ``AutoModelForCausalLM.from_pretrained``, e.g.
                ``dtype``, ``device_map``, ``gguf_file``. Without a ``device_map`` the model is
                moved to CUDA when available, else stays on CPU. Default ``dtype``: with CUDA,
                ``"auto"`` (the checkpoint's, often bfloat16: fast, but a prompt's row then
                depends on the other prompts of its batch beyond rounding); without CUDA,
                ``torch.float32``, where a row equals the same prompt's row alone up to
                float32 rounding. Pass ``dtype`` to choose either way.
            **kwargs: arguments of the constructor (``batch_size``, ``max_kv_cache_bytes``...).
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        opts = dict(hf_opts or {})
        path = Path(model_id)
        if path.suffix == ".gguf" and path.is_file():
            opts.setdefault("gguf_file", path.name)
            model_id = str(path.parent)
        tokenizer_opts = {"gguf_file": opts["gguf_file"]} if "gguf_file" in opts else {}
        tokenizer = AutoTokenizer.from_pretrained(model_id, **tokenizer_opts)
        if bitsandbytes_opts:
            from transformers import BitsAndBytesConfig

            opts["quantization_config"] = BitsAndBytesConfig(**bitsandbytes_opts)
        if "dtype" not in opts and "torch_dtype" not in opts:
            opts["dtype"] = "auto" if torch.cuda.is_available() else torch.float32
        model = AutoModelForCausalLM.from_pretrained(model_id, **opts)
        if "device_map" not in opts and not bitsandbytes_opts and torch.cuda.is_available():
            model = model.to("cuda")
        return cls(model, tokenizer, **kwargs)

    # ---- the backend contract ---------------------------------------------------------

    @property
    def max_prompt_len(self) -> int | None:
        """``max_position_embeddings`` of the model's config, when it sets one."""
        self._check_open()
        return self._max_prompt_len

    def _evaluate_logprobs(self, requests: list[LogprobsRequest]) -> list[Any]:
        results: list[Any] = [None] * len(requests)
        by_adapter: dict[str | None, list[int]] = {}
        for i, request in enumerate(requests):
            by_adapter.setdefault(request.lora_name, []).append(i)
        with self._lock, torch.no_grad():
            try:
                for adapter, slots in by_adapter.items():
                    removed = self._removed_adapter(adapter)
                    if removed is not None:  # since these requests were queued: they fail alone
                        for i in slots:
                            results[i] = removed
                        continue
                    with self._adapter(adapter):
                        self._run(
                            adapter,
                            [(i, requests[i].token_ids) for i in slots],
                            results,
                            wants_logits=True,
                        )
            finally:
                self._evict()
        return results

    # ---- key/value reuse ----------------------------------------------------------------

    def cache_kv(self, prompt_tokens: Sequence[int], lora_name: str | None = None) -> None:
        """Computes and keeps the key/value states of ``prompt_tokens`` (blocking).

        Later prompts that extend it run only their new tokens (while the states stay within
        the memory bound). Does nothing when the whole prompt is cached already.
        """
        request = self._request(prompt_tokens, lora_name)

        def work() -> None:
            with self._lock, torch.no_grad(), self._adapter(request.lora_name):
                results: list[Any] = [None]
                try:
                    self._run(
                        request.lora_name, [(0, request.token_ids)], results, wants_logits=False
                    )
                finally:
                    self._evict()
                if isinstance(results[0], BaseException):
                    raise results[0]

        self._on_engine(work)

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """One plain forward pass over the whole prompt (blocking): no batching, no caches.

        Reads and writes neither the key/value trie nor the output cache.

        Returns:
            A float32 tensor ``[V]`` of log-probabilities, on the model's device.
        """
        request = self._request(token_ids, lora_name)

        def work() -> torch.Tensor:
            with self._lock, torch.no_grad(), self._adapter(request.lora_name):
                kwargs = {"logits_to_keep": 1} if self._keeps_logits else {}
                ids = torch.tensor([request.token_ids], device=self.device)
                logits = self.model(input_ids=ids, use_cache=False, **kwargs).logits
                return logits[0, -1].float().log_softmax(dim=-1)

        return self._on_engine(work)

    def clear_kv_cache(self) -> None:
        """Forgets every cached key/value state (of every adapter)."""
        self._check_open()
        with self._lock:
            self._kv.clear()

    def clear_cache(self) -> None:
        """Empties the output cache and the key/value trie."""
        super().clear_cache()
        self.clear_kv_cache()

    def stats(self) -> dict[str, Any]:
        """Batching counters, plus forward passes, tokens run, tokens reused and the trie's size."""
        self._check_open()
        with self._lock:
            kv = {
                "num_forward_passes": self.num_forward_passes,
                "num_forward_tokens": self.num_forward_tokens,
                "num_reused_tokens": self.num_reused_tokens,
                "kv_cache_bytes": self._kv.num_bytes,
                "kv_cache_blocks": self._kv.num_blocks,
                "kv_evicted_blocks": self._kv.num_evicted_blocks,
                "max_kv_cache_bytes": self._kv.max_bytes,
            }
        return {**super().stats(), **kv}

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
            make_step(self._kv, adapter, slot, ids, wants_logits=wants_logits)
            for slot, ids in prompts
        ]
        prefixes = shared_prefixes(steps)
        if prefixes:  # run prefixes shared within the batch once, then resume every prompt
            self._run_steps(
                adapter,
                [make_step(self._kv, adapter, -1, p, wants_logits=False) for p in prefixes],
                [],
                wants_logits=False,
            )
            steps = [
                make_step(self._kv, adapter, slot, ids, wants_logits=wants_logits)
                for slot, ids in prompts
            ]
        self._run_steps(adapter, steps, results, wants_logits=wants_logits)

    def _run_steps(
        self, adapter: str | None, steps: list[Step], results: list[Any], *, wants_logits: bool
    ) -> None:
        chunks = plan_chunks(
            steps,
            vocab_size=self._vocab_size,
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
                            self._kv, adapter, step.slot, step.token_ids, wants_logits=wants_logits
                        )
                        if retry.num_new > 0:
                            self._run_chunk(adapter, [retry], results)
                    except Exception as exc_one:  # noqa: BLE001 - this prompt's own failure
                        _store(results, step.slot, _engine_error(exc_one))

    def _run_chunk(self, adapter: str | None, chunk: list[Step], results: list[Any]) -> None:
        rows = run_chunk(
            self.model,
            self._kv,
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
        num_oversized = self._kv.num_oversized_blocks
        self._kv.evict()
        if num_oversized and not self._warned_oversized:
            self._warned_oversized = True
            warnings.warn(
                "the key/value states of one forward pass exceeded "
                f"max_kv_cache_bytes={self._kv.max_bytes} "
                "and were not kept: prompts that extend them recompute everything. Raise "
                "max_kv_cache_bytes (or lower batch_size).",
                RuntimeWarning,
                stacklevel=2,
            )

    def _on_engine(self, work: Any) -> Any:
        """Runs ``work`` on the engine thread (so it never overlaps a batch) and waits."""
        self._check_open()
        return self._engine_thread.submit(work).result()

    # ---- lifecycle ------------------------------------------------------------------------

    def _close(self) -> None:
        with self._lock:
            self._kv.clear()
            self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * DEFAULT_CUDA_KV_FRACTION)
    return DEFAULT_CPU_KV_BYTES


def _store(results: list[Any], slot: int, value: Any) -> None:
    if slot >= 0:  # slot -1: a shared prefix run only for its states
        results[slot] = value


def _engine_error(exc: BaseException) -> BaseException:
    if isinstance(exc, (EngineError, InvalidRequestError)):
        return exc
    error = EngineError(f"the model failed on this prompt: {exc!r}")
    error.__cause__ = exc
    return error
