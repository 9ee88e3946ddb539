"""Tiny real models for the Hugging Face backend tests, built offline once per test process.

The model is a random-weight 2-layer Llama in fp32 (hidden 64, 4 heads, 2 KV heads,
``max_position_embeddings`` 2048) with Mistral's real 32000-token SentencePiece tokenizer
(``tests.real_tokenizers.load_tokenizer("sentencepiece")``: ``mistral_common``'s
``tokenizer.model.v1``, Apache-2.0), saved to a temporary folder. Two LoRA adapters are made
by peft with random, non-zero A and B weights (``init_lora_weights=False``), saved to their
own folders. The independent references are a plain uncached forward pass of the same
weights (:func:`reference_logprobs`) and, for adapters, a merged model (base + adapter,
``merge_and_unload``).

Builders are cached per process (``functools.cache``) so that every test module shares
them (fixtures imported into several modules would be built once per module).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

import torch

MAX_POSITIONS = 2048
VOCAB_SIZE = 32000
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@functools.cache
def _workdir() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="genlm-hf-tests-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.cache
def tiny_llama_dir() -> Path:
    """A folder with a random fp32 2-layer Llama and its 32k SentencePiece tokenizer."""
    from tiny_llama import save_random_llama

    from tests.real_tokenizers import load_tokenizer

    def spread(model: torch.nn.Module) -> None:
        # A larger spread of weights than the default init, so that distributions are far
        # from uniform and differences between prompts (or adapters) show in the rows.
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)

    return save_random_llama(
        _workdir() / "tiny-llama",
        load_tokenizer("sentencepiece"),
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_positions=MAX_POSITIONS,
        adjust=spread,
    )


def load_tiny_llama(dtype: torch.dtype = torch.float32):
    """A fresh copy of the tiny Llama (tests that modify a model get their own)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir(), dtype=dtype).eval()


@functools.cache
def shared_tiny_llama():
    """One read-only fp32 tiny Llama for every test that does not modify it."""
    return load_tiny_llama()


@functools.cache
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir())


@functools.cache
def lora_dir(name: str) -> Path:
    """A random LoRA adapter (rank 4, every projection) for the tiny Llama; seed from ``name``."""
    from peft import LoraConfig, get_peft_model

    folder = _workdir() / f"lora-{name}"
    torch.manual_seed(sum(map(ord, name)))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(load_tiny_llama(), config)
    with torch.no_grad():  # B is non-zero with init_lora_weights=False; make it count
        for module_name, param in peft_model.named_parameters():
            if "lora_B" in module_name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(folder)
    return folder


@functools.cache
def merged_model(name: str):
    """The tiny Llama with adapter ``name`` merged into its weights: the adapter's reference."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_tiny_llama(), lora_dir(name)).merge_and_unload().eval()


def reference_logprobs(model, token_ids) -> torch.Tensor:
    """An independent reference: a plain uncached forward pass, fp32 log-softmax of the last row."""
    with torch.no_grad():
        logits = model(torch.tensor([list(token_ids)], device=model.device)).logits
    return logits[0, -1].float().log_softmax(-1).cpu()


def random_prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB_SIZE, (length,), generator=generator).tolist()


def trie_nodes(kv) -> int:
    """The nodes of every trie of a ``KVTrie`` (its roots not counted)."""
    stack = [trie.root for trie in kv._tries.values()]
    total = 0
    while stack:
        node = stack.pop()
        total += 1
        stack.extend((node.children or {}).values())
    return total - len(kv._tries)
