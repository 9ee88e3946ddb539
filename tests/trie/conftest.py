"""Shared fixtures of the trie tests: real decoded vocabularies, loaded once per process."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest

_REPO_ROOT = str(Path(__file__).resolve().parents[2])
if _REPO_ROOT not in sys.path:  # plain `pytest` (not `python -m pytest`) leaves it out
    sys.path.insert(0, _REPO_ROOT)

from genlm_backend.tokenization import decode_vocab
from tests.real_tokenizers import load_tokenizer


@functools.cache
def _byte_vocab(family: str) -> list:
    return decode_vocab(load_tokenizer(family))[0]


@pytest.fixture(scope="session")
def byte_vocab():
    """``byte_vocab(family)``: the decoded ``list[Token]`` of a real tokenizer (cached; do not
    mutate)."""
    return _byte_vocab
