"""Token-character tries: from token weights to the weight of every byte prefix.

* :class:`TokenCharacterTrie` — the trie and its sequential (numpy) ``weight_sum`` /
  ``weight_max``;
* :class:`ParallelTokenCharacterTrie` — the same results as batched torch operations on any
  device;
* :class:`AsyncTokenCharacterTrie` — batches concurrent ``await weight_sum(...)`` calls.
"""

from .async_trie import AsyncTokenCharacterTrie
from .character_trie import TokenCharacterTrie
from .parallel import ParallelTokenCharacterTrie

__all__ = ["AsyncTokenCharacterTrie", "ParallelTokenCharacterTrie", "TokenCharacterTrie"]
