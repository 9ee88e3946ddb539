"""Without vLLM: the package imports, the other backends work, and the vLLM backend names the
pip command that installs its engine when it is used.

These tests are about vllm's absence, so they run only where vllm cannot be imported: the
no-vLLM lane (``scripts/run_tests_novllm.sh``), and ``tests/test_package.py``, which runs this
file with vllm hidden (``GENLM_TESTS_HIDE_VLLM=1``, see ``tests/conftest.py``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if importlib.util.find_spec("vllm") is not None:
    pytest.skip("about running without vLLM, which is installed here", allow_module_level=True)

import genlm_backend
from genlm_backend import AsyncVirtualLM, load_model_by_name
from genlm_backend.llm import AsyncLM, AsyncTransformer, MockAsyncLM
from genlm_backend.llm.loading import is_vllm_usable

PIP_COMMAND = "pip install vllm"


def save_tiny_model(folder) -> str:
    """A random one-layer Llama with a six-token word-level tokenizer, saved to ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4, "ab": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def test_every_export_imports_and_vllm_stays_out():
    for name in genlm_backend.__all__:
        assert getattr(genlm_backend, name) is not None, name
    assert issubclass(AsyncVirtualLM, AsyncLM)
    assert AsyncVirtualLM.__name__ == "AsyncVirtualLM"
    assert sys.modules.get("vllm") is None


def test_using_the_vllm_backend_raises_import_error_naming_the_pip_command(tmp_path):
    with pytest.raises(ImportError, match=PIP_COMMAND):
        AsyncVirtualLM.from_name("any-model")
    with pytest.raises(ImportError, match=PIP_COMMAND):
        AsyncVirtualLM(object())
    with pytest.raises(ImportError, match=PIP_COMMAND):
        load_model_by_name("any-model", backend="vllm")


def test_load_model_by_name_picks_hf_and_it_works(tmp_path):
    assert not is_vllm_usable()
    folder = save_tiny_model(tmp_path)
    with load_model_by_name(folder) as lm:
        assert type(lm) is AsyncTransformer
        row = lm.next_token_logprobs_sync([1, 3, 4])
        assert row.shape == (6,) and abs(torch.logsumexp(row, 0).item()) < 1e-5
    with load_model_by_name(folder, backend="mock") as mock:
        assert type(mock) is MockAsyncLM and mock.next_token_logprobs_sync([1, 3]).shape == (6,)


def test_the_genlm_backend_alias_works_without_vllm(tmp_path):
    folder = save_tiny_model(tmp_path)
    code = f"""
        import os, sys
        if os.environ.get("GENLM_TESTS_HIDE_VLLM"):
            sys.modules["vllm"] = None  # as in the test process (tests/conftest.py)
        import genlm_backend
        genlm_backend.install_genlm_alias()
        from genlm.backend import AsyncVirtualLM, load_model_by_name
        from genlm.backend.llm import AsyncTransformer
        assert AsyncVirtualLM is genlm_backend.AsyncVirtualLM
        try:
            AsyncVirtualLM.from_name("any-model")
        except ImportError as exc:
            assert {PIP_COMMAND!r} in str(exc), exc
        else:
            raise AssertionError("AsyncVirtualLM.from_name worked without vllm")
        with load_model_by_name({folder!r}) as lm:
            assert type(lm) is AsyncTransformer, type(lm)
        print("ok", "vllm" in sys.modules and sys.modules["vllm"] is not None)
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=300, env=os.environ.copy(), check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "False"]
