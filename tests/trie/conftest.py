"""Shared fixtures of the trie tests: real decoded vocabularies, loaded once per process."""

from __future__ import annotations

import functools

import pytest

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
