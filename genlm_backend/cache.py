"""An LRU cache of model outputs (log-probability rows), keyed by request and adapter."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from cachetools import LRUCache

__all__ = ["OutputCache"]


class OutputCache:
    """A least-recently-used mapping from a key to a tensor.

    Keys are whatever the backend passes, for the LM backends ``(token_ids, lora_name)``, so
    results of different adapters never mix. Reading a key marks it most recently used;
    writing past ``maxsize`` evicts the least recently used entry.

    Args:
        maxsize: the largest number of entries kept (>= 1).
        move_to_cpu: store entries on the CPU (freeing device memory) and move them back to
            the device they came from when read.

    Raises:
        ValueError: for a ``maxsize`` below 1.
    """

    def __init__(self, maxsize: int, move_to_cpu: bool = False):
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be a positive int, got {maxsize!r}")
        self.maxsize = maxsize
        self.move_to_cpu = move_to_cpu
        self._entries: LRUCache = LRUCache(maxsize=maxsize)

    def __getitem__(self, key: Hashable) -> Any:
        value, device = self._entries[key]
        if device is not None:
            return value.to(device)
        return value

    def __setitem__(self, key: Hashable, value: Any) -> None:
        device = None
        if self.move_to_cpu and isinstance(value, torch.Tensor) and value.device.type != "cpu":
            device = value.device
            value = value.to("cpu")
        self._entries[key] = (value, device)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, default: Any = None) -> Any:
        """Returns the entry for ``key`` (marking it recently used), or ``default``."""
        try:
            return self[key]
        except KeyError:
            return default

    def clear(self) -> None:
        """Removes every entry."""
        self._entries.clear()
