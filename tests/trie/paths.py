"""The two CPU paths of ``ParallelTokenCharacterTrie``'s ``"auto"`` strategy: the compiled
kernel (``genlm_backend.trie._kernel``) and the torch / numpy fallback used where it was
not built. Tests parametrised with :data:`CPU_PATHS` run on both."""

from __future__ import annotations

from unittest import mock

import pytest

from genlm_backend.trie import ParallelTokenCharacterTrie, _compiled

KERNEL_BUILT = _compiled.KERNEL is not None
CPU_PATHS = [
    pytest.param(
        "compiled",
        marks=pytest.mark.skipif(not KERNEL_BUILT, reason="the compiled trie kernel was not built"),
    ),
    "fallback",
]


def parallel_trie(vocab, path: str, **opts) -> ParallelTokenCharacterTrie:
    """A ``ParallelTokenCharacterTrie`` (strategy ``"auto"``) that computes on the CPU on
    ``path``: ``"compiled"`` or ``"fallback"`` (as if the extension had not been built)."""
    if path == "compiled":
        trie = ParallelTokenCharacterTrie(vocab, **opts)
    else:
        with mock.patch.object(_compiled, "KERNEL", None):
            trie = ParallelTokenCharacterTrie(vocab, **opts)
    assert trie._use_compiled == (path == "compiled")
    return trie
