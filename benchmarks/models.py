"""The random-weight models and engine options that the vLLM workloads share.

Weights are random: the workloads time the backend around the model, and every result is a
ratio against a floor run on the same weights. ``build_model`` saves a model folder once and
reuses it, so the first run of a configuration pays for building it.

- ``GPU_CONFIG``: a 1.2B Llama in bf16 with Mistral's 131k tekken vocabulary (give
  ``--tokenizer-dir``, made by ``prepare_gpu_assets.py``).
- ``GPU_8B_CONFIG``: Llama-3.1-8B's shape, likewise in bf16 with tekken (``--gpu --size 8b``).
- ``TINY_CONFIG``: a small fp32 Llama with Mistral's 32k SentencePiece tokenizer (from
  ``mistral_common``), for CPU runs.
- ``MICRO_CONFIG``: 256 outputs and one small layer: on a CPU its forward pass costs next to
  nothing, so a step is host-side work alone, ours and vLLM's, as on a GPU (the diagnostics'
  ``--micro``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

import torch

GPU_CONFIG = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 8192}
GPU_8B_CONFIG = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "intermediate_size": 14336}
# The GPU configurations by ``--size``: the architecture and where its model is built.
GPU_SIZES = {"1b": (GPU_CONFIG, "/tmp/w1_llama_1b"), "8b": (GPU_8B_CONFIG, "/tmp/w1_llama_8b")}
TINY_CONFIG = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 1, "intermediate_size": 256}
MICRO_CONFIG = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 256}

# The engine options of the workloads of record (``bench_smc_vllm.py``), by configuration.
GPU_ENGINE_OPTS = {
    "gpu_memory_utilization": 0.6,
    "max_model_len": 2048,
    "enable_prefix_caching": True,
}
CPU_ENGINE_OPTS = {"max_model_len": 512, "dtype": "float32", "enable_prefix_caching": True}


def build_model(out: Path, tokenizer_dir: Path | None, arch: dict, dtype: torch.dtype) -> Path:
    """Saves a random-weight Llama with ``arch`` and the tokenizer into ``out`` (reused if
    there)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:  # Mistral's 32k SentencePiece tokenizer, from mistral_common
        import shutil

        import mistral_common
        from transformers import LlamaTokenizer

        shutil.copy(
            Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1",
            out / "tokenizer.model",
        )
        tokenizer = LlamaTokenizer.from_pretrained(str(out))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(out))
    config = LlamaConfig(
        **{"vocab_size": len(tokenizer), **arch},
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # the weights are made in ``dtype``, never in fp32 first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(str(out))
    del model
    return out


def workload_model(gpu: bool, model_dir: str | None = None, tokenizer_dir: Path | None = None,
                   micro: bool = False, size: str = "1b") -> tuple[Path, dict[str, Any]]:
    """The model folder (built if missing) and engine options of a configuration: a GPU
    one (by ``size``), the tiny CPU one, or the micro CPU one."""
    if gpu:
        arch, default = GPU_SIZES[size]
        folder = build_model(Path(model_dir or default), tokenizer_dir, arch, torch.bfloat16)
        return folder, dict(GPU_ENGINE_OPTS)
    arch, default = (
        (MICRO_CONFIG, "/tmp/w1_micro_llama") if micro else (TINY_CONFIG, "/tmp/w1_tiny_llama")
    )
    return build_model(Path(model_dir or default), tokenizer_dir, arch, torch.float32), dict(
        CPU_ENGINE_OPTS
    )


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The flags that choose a workload's model (read by :func:`workload`)."""
    parser.add_argument(
        "--gpu", action="store_true", help="a bf16 Llama with tekken (131k) on CUDA"
    )
    parser.add_argument(
        "--size", choices=sorted(GPU_SIZES), default="1b",
        help="the GPU model: 1.2B, or Llama-3.1-8B's shape",
    )
    parser.add_argument(
        "--tokenizer-dir", type=Path, default=None, help="HF tokenizer folder (GPU: tekken)"
    )
    parser.add_argument(
        "--model-dir", default=None, help="where the random model is built (reused if present)"
    )


def parse_opts(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` engine options; VALUE parsed as JSON when it can be."""
    opts = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def workload(
    args: argparse.Namespace, micro: bool = False
) -> tuple[Path, dict[str, Any], list[int]]:
    """What a W1-shaped script runs on, from its flags (``gpu``, ``size``, ``model_dir``,
    ``tokenizer_dir``, ``engine_opt``, ``seed``, ``prompt_len``): the model folder, the
    engine options with ``--engine-opt`` applied, and W1's prompt (seeded random ids above
    the tokenizer's special tokens)."""
    model_dir, opts = workload_model(args.gpu, args.model_dir, args.tokenizer_dir, micro=micro,
                                     size=args.size)
    opts.update(parse_opts(args.engine_opt))
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    return (
        model_dir,
        opts,
        [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)],
    )
