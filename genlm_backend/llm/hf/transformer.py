"""`AsyncTransformer`: the Hugging Face transformers backend, with key/value reuse across prompts.

Requests are auto-batched by the shared batcher of :class:`~genlm_backend.llm.base.AsyncLM`.
Each batch is evaluated by the engine (:mod:`.transformer_engine`) on its thread: every
prompt resumes from the longest prefix whose key/value states are cached in a token trie
(:mod:`.kvtrie`), the remaining tokens of all prompts run in as few padded forward passes as
possible (:mod:`.forward`), and the new states go back into the trie. Memory for those
states is bounded (see ``max_kv_cache_bytes``), with least-recently-used eviction.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..base import AsyncLM, LogprobsRequest, stops_what_it_started
from ..engine import EngineAttribute
from .transformer_engine import TransformerEngine

__all__ = ["AsyncTransformer"]

DEFAULT_CPU_KV_BYTES = 2 << 30
DEFAULT_CUDA_KV_FRACTION = 0.25


class AsyncTransformer(AsyncLM):
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
        device = hf_model.get_input_embeddings().weight.device
        if max_kv_cache_bytes is None:
            max_kv_cache_bytes = _default_kv_bytes(device)
        engine = TransformerEngine(hf_model, max_kv_cache_bytes, max_forward_tokens)
        super().__init__(hf_tokenizer, engine, batch_size=batch_size, timeout=timeout, **kwargs)
        self.device = engine.device

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

    # The engine's: the model (a peft model while adapters are loaded; None once cleaned up),
    # the most new tokens of one grouped forward pass, and the counters of :meth:`stats`.
    model = EngineAttribute()
    max_forward_tokens = EngineAttribute()
    num_forward_passes = EngineAttribute()
    num_forward_tokens = EngineAttribute()
    num_reused_tokens = EngineAttribute()

    # ---- key/value reuse ----------------------------------------------------------------

    def cache_kv(self, prompt_tokens: Sequence[int], lora_name: str | None = None) -> None:
        """Computes and keeps the key/value states of ``prompt_tokens`` (blocking).

        Later prompts that extend it run only their new tokens (while the states stay within
        the memory bound). Does nothing when the whole prompt is cached already.
        """
        request = self._request(prompt_tokens, lora_name)
        self._on_engine(self.engine.cache_kv, request)

    def next_token_logprobs_uncached(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> torch.Tensor:
        """One plain forward pass over the whole prompt (blocking): no batching, no caches.

        Reads and writes neither the key/value trie nor the output cache.

        Returns:
            A float32 tensor ``[V]`` of log-probabilities, on the model's device.
        """
        request = self._request(token_ids, lora_name)
        return self._on_engine(self.engine.uncached_row, request)

    def clear_kv_cache(self) -> None:
        """Forgets every cached key/value state (of every adapter)."""
        self._check_open()
        with self.engine.lock:
            self.engine.kv.clear()

    def clear_cache(self) -> None:
        """Empties the output cache and the key/value trie."""
        super().clear_cache()
        self.clear_kv_cache()

    def stats(self) -> dict[str, Any]:
        """Batching counters, plus forward passes, tokens run, tokens reused and the trie's size."""
        self._check_open()
        return super().stats()

    def _on_engine(self, work: Any, request: LogprobsRequest) -> Any:
        """Runs ``work(request)`` on the engine thread (so it never overlaps a batch), waits."""
        self._check_open()
        return self.engine.run(work, request)


def _default_kv_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total * DEFAULT_CUDA_KV_FRACTION)
    return DEFAULT_CPU_KV_BYTES
