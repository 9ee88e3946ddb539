"""The two real backends agree: vLLM and transformers, same tiny fp32 weights.

Tolerance 1e-4 (max abs difference of log-probabilities) on the CPU: both compute in fp32,
but with different kernels (vLLM's CPU attention and fused ops against eager PyTorch), so
the rows differ by float rounding only, measured around 1e-5. On CUDA: ``ROW_ATOL`` of the
vLLM fixtures (vLLM's GPU kernels; see there).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from vllm_fixtures import ROW_ATOL, cpu_lora

from genlm_backend.llm.hf import AsyncTransformer

TOLERANCE = ROW_ATOL

PROMPTS = [[1, 415], [1, 415, 2936, 9060], [1] + list(range(300, 340)), [1, 22557, 28725, 910]]


@pytest.fixture(scope="module")
def hf_lm(tiny_model_dirs):
    lm = AsyncTransformer.from_name(str(tiny_model_dirs["base"]), hf_opts={"dtype": torch.float32})
    yield lm
    lm.cleanup()


def test_vllm_and_hf_rows_agree(vlm, hf_lm):
    async def both():
        hf_rows = await hf_lm.batch_next_token_logprobs(PROMPTS)
        vllm_rows = await vlm.batch_next_token_logprobs(PROMPTS)
        return hf_rows, vllm_rows

    hf_rows, vllm_rows = asyncio.run(both())
    assert hf_rows.shape == vllm_rows.shape == (len(PROMPTS), hf_lm.vocab_size)
    assert (hf_rows.cpu() - vllm_rows.cpu()).abs().max().item() <= TOLERANCE


@cpu_lora
def test_vllm_and_hf_rows_agree_with_an_adapter(vlm, hf_lm, tiny_model_dirs):
    hf_lm.add_new_lora(str(tiny_model_dirs["adapter"]), "adapter")
    vlm.add_new_lora(str(tiny_model_dirs["adapter"]), "adapter")
    for prompt in PROMPTS[:2]:
        hf_row = hf_lm.next_token_logprobs_sync(prompt, lora_name="adapter")
        vllm_row = vlm.next_token_logprobs_sync(prompt, lora_name="adapter")
        base_row = hf_lm.next_token_logprobs_sync(prompt)
        assert (hf_row.cpu() - vllm_row.cpu()).abs().max().item() <= TOLERANCE
        assert (hf_row - base_row).abs().max().item() > 100 * 1e-4  # the adapter matters
