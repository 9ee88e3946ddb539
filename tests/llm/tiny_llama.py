"""One builder for the random-weight tiny Llamas that the backend tests run on."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def save_random_llama(
    folder: Path,
    tokenizer: Any,
    *,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    max_positions: int,
    num_hidden_layers: int = 2,
    seed: int = 0,
    adjust: Callable[[torch.nn.Module], None] | None = None,
) -> Path:
    """Saves a random fp32 Llama sized for ``tokenizer`` (and the tokenizer) into ``folder``.

    ``adjust(model)`` runs under ``torch.no_grad()`` before saving: the tests use it to make
    distributions sharper than the default initialisation gives.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return folder
