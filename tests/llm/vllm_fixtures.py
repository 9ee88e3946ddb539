"""Tiny real models for the vLLM tests, built offline, and session-scoped engines on them.

The model is a random 2-layer Llama in fp32 (hidden 128, 2 heads of 64, 1 KV head) with
Mistral's real 32000-token SentencePiece tokenizer (``mistral_common``'s
``tokenizer.model.v1``, Apache-2.0). The LoRA adapter is a random peft adapter on the same
model, and the merged model (base + adapter) is saved as its own folder: the independent
reference the LoRA tests compare against.

Engines take 5-15 s to start on two cores, so every test module shares the engines below.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MAX_MODEL_LEN = 512
# Small scheduler limits so that one batch of capture requests spans several engine steps
# (chunked prefill, more prompts than max_num_seqs).
ENGINE_OPTS = {
    "dtype": "float32",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "enable_chunked_prefill": True,
    "enable_lora": True,
    "max_lora_rank": 8,
    "max_loras": 2,
    "seed": 0,
}

# On a GPU machine several small engines share one device, and compiling is wasted.
GPU_ENGINE_OPTS = (
    {"gpu_memory_utilization": 0.15, "enforce_eager": True} if torch.cuda.is_available() else {}
)
ENGINE_OPTS.update(GPU_ENGINE_OPTS)


ON_GPU = torch.cuda.is_available()
# Rows against the fp32 transformers reference on the CPU. On CPU: the bar, 1e-4
# (measured about 1e-5). On CUDA, vLLM computes this fp32 model with its GPU kernels (Triton
# attention, whose fp32 dot products default to TF32): measured 0.6-1.1e-2 on an H100 with
# vLLM 0.26.
ROW_ATOL = 2e-2 if ON_GPU else 1e-4
# vLLM's CUDA LoRA kernels take fp16/bf16 weights only (``lora/ops/triton_ops``, 0.26 and
# 0.32); the LoRA tests compare an fp32 model against its merged twin, so they run on CPU.
cpu_lora = pytest.mark.skipif(ON_GPU, reason="vLLM's CUDA LoRA kernels refuse fp32 weights")


def prompts_of(lengths, seed=0) -> list[list[int]]:
    """Random prompts of the given lengths over the tiny model's ids (above the special ones)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(n)] for n in lengths]


def assert_matches(row, reference, atol: float = ROW_ATOL) -> None:
    """``row`` is an fp32 row of ``reference``'s shape within ``atol`` (compared on the CPU)."""
    assert row.dtype == reference.dtype == torch.float32 and row.shape == reference.shape
    assert (row.cpu() - reference.cpu()).abs().max().item() <= atol


def assert_same_rows(a, b) -> None:
    """Rows of one context computed in different batches: identical on CPU; on CUDA the
    kernels depend on the batch's shape, so within float rounding."""
    if ON_GPU:
        assert (a.cpu() - b.cpu()).abs().max().item() <= 1e-3
    else:
        assert torch.equal(a, b)


def before_each_attempt(monkeypatch, runner, hook) -> None:
    """Calls ``hook(jobs)`` each time ``runner`` (an EngineRunner) is about to add ``jobs`` to
    its engine, first try and retries alike: a hook that raises stands for an engine failure."""
    run_once = runner._run_once

    def patched(jobs, continued=None):
        hook(jobs)
        return run_once(jobs, continued)

    monkeypatch.setattr(runner, "_run_once", patched)


def front_on_shared_engine(llm, **kwargs):
    """A second ``AsyncVirtualLM`` on the shared engine ``llm``: its cleanup closes its own
    sessions and capture sink but leaves the engine running."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM(llm, **kwargs)
    engine = lm.engine

    def leave_running() -> None:
        engine._sessions.close_all()
        engine._sink.close()

    engine._shutdown = leave_running  # the engine thread's last task
    return lm


def engine_broke(jobs) -> None:
    """A hook for :func:`before_each_attempt`: every attempt fails as a broken engine would."""
    raise RuntimeError("engine broke")


def build_tiny_llama(folder: Path, seed: int = 0) -> Path:
    """Saves a random fp32 2-layer Llama plus Mistral's 32k tokenizer into ``folder``."""
    from tiny_llama import save_random_llama
    from transformers import LlamaTokenizer

    from tests.real_tokenizers import mistral_data_dir

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(mistral_data_dir() / "tokenizer.model.v1", folder / "tokenizer.model")

    def sharpen(model) -> None:  # larger logits than the default init: sharper distributions
        model.lm_head.weight.mul_(20.0)

    return save_random_llama(
        folder,
        LlamaTokenizer.from_pretrained(str(folder)),
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_positions=MAX_MODEL_LEN,
        seed=seed,
        adjust=sharpen,
    )


def build_lora(base: Path, adapter_dir: Path, merged_dir: Path, seed: int = 1) -> None:
    """Saves a random peft LoRA adapter of ``base`` and the merged model it stands for."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"], lora_dropout=0.0
    )
    peft_model = get_peft_model(model, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(str(adapter_dir))
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(str(merged_dir))
    for name in (
        "tokenizer.model",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
    ):
        if (base / name).exists():
            shutil.copy(base / name, merged_dir / name)
            shutil.copy(base / name, adapter_dir / name)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Folders: ``base`` (random tiny Llama), ``adapter`` (peft LoRA), ``merged``."""
    root = tmp_path_factory.mktemp("vllm_models")
    base = build_tiny_llama(root / "base")
    build_lora(base, root / "adapter", root / "merged")
    return {"base": base, "adapter": root / "adapter", "merged": root / "merged"}


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dirs):
    """``logprobs(folder, token_ids) -> [V]``: a plain transformers forward pass in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}

    def logprobs(which: str, token_ids) -> torch.Tensor:
        if which not in models:
            models[which] = AutoModelForCausalLM.from_pretrained(
                str(tiny_model_dirs[which]), dtype=torch.float32
            ).eval()
        with torch.no_grad():
            logits = models[which](torch.tensor([list(token_ids)])).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs


@pytest.fixture(scope="session")
def vllm_lm(tiny_model_dirs):
    """The shared AsyncVirtualLM on the tiny model (LoRA enabled, small scheduler limits)."""
    from genlm_backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(str(tiny_model_dirs["base"]), engine_opts=dict(ENGINE_OPTS))
    yield lm
    lm.cleanup()


@pytest.fixture
def vlm(vllm_lm):
    """The shared model, with a clean adapter state, cache and queue for every test."""
    vllm_lm.clear_lora()
    vllm_lm.clear_cache()
    vllm_lm.close_sessions()
    vllm_lm.set_sessions(True)
    yield vllm_lm
    # Once other engine work ends the hold of the last step, no request may be left running:
    # a row delivered early must not leave its engine request generating.
    scheduler = vllm_lm.llm.llm_engine.engine_core.engine_core.scheduler
    if not vllm_lm.is_closed:
        running, _ = vllm_lm.engine.thread.submit(scheduler.get_request_counts).result(timeout=120)
        assert running == 0, f"{running} engine requests still running after the test"
    vllm_lm.clear_lora()
    for name in list(vllm_lm._lora_paths):
        vllm_lm.remove_lora(name)


@pytest.fixture(scope="session")
def second_adapter_dirs(tiny_model_dirs, tmp_path_factory) -> dict[str, Path]:
    """A second random peft adapter of the tiny model (another seed): ``adapter`` and the
    ``merged`` model it stands for, for batches that mix two adapters and the base model."""
    root = tmp_path_factory.mktemp("vllm_second_adapter")
    build_lora(tiny_model_dirs["base"], root / "adapter", root / "merged", seed=2)
    return {"adapter": root / "adapter", "merged": root / "merged"}


@pytest.fixture(scope="session")
def lora_reference(hf_reference, second_adapter_dirs):
    """``logprobs(lora_name, token_ids) -> [V]`` for adapter names None (the base model),
    ``"a"`` (the ``adapter`` of :func:`tiny_model_dirs`) and ``"b"`` (:func:`second_adapter_dirs`):
    a plain transformers forward pass of the base or merged weights in fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    second: list = []

    def logprobs(lora_name, token_ids) -> torch.Tensor:
        if lora_name is None:
            return hf_reference("base", token_ids)
        if lora_name == "a":
            return hf_reference("merged", token_ids)
        if lora_name != "b":
            raise KeyError(lora_name)
        if not second:
            second.append(AutoModelForCausalLM.from_pretrained(
                str(second_adapter_dirs["merged"]), dtype=torch.float32).eval())
        with torch.no_grad():
            logits = second[0](torch.tensor([list(token_ids)])).logits[0, -1]
        return torch.log_softmax(logits.float(), dim=-1)

    return logprobs
