"""What this package installed on vLLM's objects, kept beside them rather than on them."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["installed_on"]

# id(object) -> (a weak reference to it, what was installed on it)
_INSTALLED: dict[int, tuple[weakref.ref, dict[str, Any]]] = {}


def installed_on(obj: Any) -> dict[str, Any]:
    """What was installed on ``obj`` (a vLLM object), by name: empty at first, forgotten
    when ``obj`` is. A value must not refer to ``obj`` (it would keep ``obj`` alive): a
    value that does is kept as a weak reference to it. ``obj`` must take weak references
    (vLLM's schedulers, model runners, workers and LoRA wrappers do)."""
    key = id(obj)
    entry = _INSTALLED.get(key)
    if entry is None or entry[0]() is not obj:
        entry = (weakref.ref(obj, lambda _, key=key: _INSTALLED.pop(key, None)), {})
        _INSTALLED[key] = entry
    return entry[1]
