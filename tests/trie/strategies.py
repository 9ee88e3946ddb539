"""Hypothesis strategies for trie vocabularies and weights, and the consumers' EOS object.

Vocabularies are drawn to stress the trie: a tiny alphabet (so tokens share prefixes),
empty tokens, duplicates, multi-byte UTF-8 characters cut across tokens, ``Token`` objects
whose ids differ from their positions, and end-of-sequence objects anywhere in the list.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from genlm_backend.tokenization import Token

# One- to four-byte pieces; byte strings are cut at any offset, so multi-byte characters
# end up split across tokens.
PIECES = [b"a", b"b", b"\x00", b"\xff", "é".encode(), "€".encode(), "😀".encode()]


class EndOfSequence:
    """A non-bytes, hashable end-of-sequence object that iterates to itself, like the one a
    constrained sampler appends to its vocabulary."""

    def __init__(self, name: str = "EOS"):
        self.name = name

    def __iter__(self):
        yield self

    def __repr__(self) -> str:
        return self.name


@st.composite
def byte_strings(draw, max_pieces: int = 4) -> bytes:
    """Up to ``max_pieces`` pieces joined, then possibly cut to a random slice."""
    joined = b"".join(draw(st.lists(st.sampled_from(PIECES), max_size=max_pieces)))
    if draw(st.booleans()):
        start = draw(st.integers(0, len(joined)))
        joined = joined[start : draw(st.integers(start, len(joined)))]
    return joined


@st.composite
def vocabularies(draw, min_size: int = 1, max_size: int = 30, tokens=None, eos=None) -> list:
    """A vocabulary list; ``tokens``/``eos`` force (True) or forbid (False) ``Token`` items
    and end-of-sequence objects, ``None`` lets hypothesis choose."""
    words = draw(st.lists(byte_strings(), min_size=min_size, max_size=max_size))
    if draw(st.booleans()):  # duplicates, anywhere
        words = words + draw(st.lists(st.sampled_from(words), max_size=4))
        words = list(draw(st.permutations(words)))
    use_tokens = draw(st.booleans()) if tokens is None else tokens
    if use_tokens:
        ids = draw(st.permutations(range(len(words))))
        shift = draw(st.sampled_from([0, 1000]))
        words = [Token(token_id=shift + i, byte_string=w) for i, w in zip(ids, words)]
    use_eos = draw(st.booleans()) if eos is None else eos
    if use_eos:
        objects = [EndOfSequence(f"EOS{k}") for k in range(draw(st.integers(1, 2)))]
        for obj in objects + draw(st.lists(st.sampled_from(objects), max_size=1)):
            words.insert(draw(st.integers(0, len(words))), obj)
        if draw(st.booleans()):  # the usual place: last
            words.append(words.pop(words.index(objects[0])))
    return words


def weight_vectors(size: int, *, log: bool = False, signed: bool = True) -> st.SearchStrategy:
    """``[size]`` float64 weights: probabilities-like, signed, or log-weights with -inf."""
    low = -50.0 if (log or signed) else 0.0
    element = st.floats(low, 50.0, allow_nan=False, allow_infinity=False)
    if log:
        element = st.one_of(element, st.just(-np.inf))
    else:
        element = st.one_of(element, st.just(0.0))
    return st.lists(element, min_size=size, max_size=size).map(
        lambda xs: np.asarray(xs, dtype=np.float64)
    )


@st.composite
def vocab_and_weights(draw, batch: int = 1, log: bool = False, signed: bool = True, **vocab_opts):
    """``(vocab, weights [batch, V])``."""
    vocab = draw(vocabularies(**vocab_opts))
    rows = [draw(weight_vectors(len(vocab), log=log, signed=signed)) for _ in range(batch)]
    return vocab, np.stack(rows)
