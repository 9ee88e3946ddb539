"""Shared helpers of the tokenization tests: real tokenizers and their decoded vocabularies."""

from __future__ import annotations

import functools

import pytest

from genlm_backend.tokenization import decode_vocab
from tests.real_tokenizers import load_tokenizer


@functools.cache
def _decoded(family: str):
    return decode_vocab(load_tokenizer(family))


@pytest.fixture(scope="session")
def decoded():
    """``decoded(family)``: ``decode_vocab`` of the cached tokenizer of ``family``, computed
    once per process (callers must not mutate the lists)."""
    return _decoded
