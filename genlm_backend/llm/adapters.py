"""LoRA adapter bookkeeping shared by every backend: names, integer ids, the active adapter.

:class:`~genlm_backend.llm.base.AsyncLM` mixes this in; its engine loads and unloads the
adapters where it has the capability (:class:`~.engine.AdapterEngine`), else they are refused.
"""

from __future__ import annotations

import hashlib
import os

from ..exceptions import InvalidRequestError

__all__ = ["Adapters"]


class Adapters:
    """The adapter methods of the contract. Expects ``engine``, ``_check_open`` and
    ``clear_cache`` from the class it is mixed into."""

    def _init_adapters(self) -> None:
        self._lora_paths: dict[str, str] = {}
        self._lora_ids: dict[str, int] = {}
        self.active_lora: str | None = None

    @staticmethod
    def hash_to_int(name: str) -> int:
        """The integer id of adapter ``name``: shake_128 (4 bytes, big-endian) mod (2^31 - 2),
        plus 1.

        Always in [1, 2^31 - 1]; the same ids as the reference library gives.
        """
        digest = hashlib.shake_128(name.encode("utf-8")).digest(4)
        return int.from_bytes(digest, "big") % (2**31 - 2) + 1

    def add_new_lora(self, lora_path: str, lora_name: str = "lora_1") -> None:
        """Loads the adapter at ``lora_path`` (a local folder) under ``lora_name``.

        Does not activate it: pass ``lora_name=`` per call, or call :meth:`set_lora`.

        Raises:
            InvalidRequestError: ``lora_name`` is taken by another path, or its id collides
                with the id of another registered name (rename one of them).
        """
        self._check_open()
        if not isinstance(lora_name, str) or not lora_name:
            raise InvalidRequestError(f"lora_name must be a non-empty str, got {lora_name!r}")
        lora_path = os.fspath(lora_path)
        if self._lora_paths.get(lora_name) == lora_path:
            return
        if lora_name in self._lora_paths:
            raise InvalidRequestError(
                f"an adapter named {lora_name!r} is already loaded from "
                f"{self._lora_paths[lora_name]!r}; "
                "remove_lora() it first"
            )
        lora_id = self.hash_to_int(lora_name)
        for other, other_id in self._lora_ids.items():
            if other_id == lora_id:
                raise InvalidRequestError(
                    f"adapter names {lora_name!r} and {other!r} hash to the same id {lora_id}; "
                    "rename one of them"
                )
        load = getattr(self.engine, "load_adapter", None)
        if load is None:
            raise NotImplementedError(f"{type(self).__name__} does not support LoRA adapters")
        load(lora_name, lora_path, lora_id)
        self._lora_paths[lora_name] = lora_path
        self._lora_ids[lora_name] = lora_id

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Activates a loaded adapter for every call that names none.

        Raises:
            InvalidRequestError: no adapter named ``lora_name`` was loaded (``add_new_lora``).
        """
        self._check_open()
        if lora_name not in self._lora_paths:
            raise InvalidRequestError(
                f"no LoRA adapter named {lora_name!r} is loaded; call add_new_lora() first"
            )
        self.active_lora = lora_name

    def clear_lora(self) -> None:
        """Deactivates the active adapter: calls that name none use the base model."""
        self._check_open()
        self.active_lora = None

    def remove_lora(self, lora_name: str) -> None:
        """Unloads an adapter and drops its cached results.

        Raises:
            InvalidRequestError: no adapter of that name is loaded.
        """
        self._check_open()
        if lora_name not in self._lora_paths:
            raise InvalidRequestError(f"no LoRA adapter named {lora_name!r} is loaded")
        self.engine.unload_adapter(lora_name)
        del self._lora_paths[lora_name]
        del self._lora_ids[lora_name]
        if self.active_lora == lora_name:
            self.active_lora = None
        self.clear_cache()

    def _resolve_lora(self, lora_name: str | None) -> str | None:
        if lora_name is None:
            return self.active_lora
        if not isinstance(lora_name, str):
            raise InvalidRequestError(f"lora_name must be a str or None, got {lora_name!r}")
        if lora_name not in self._lora_paths:
            raise InvalidRequestError(
                f"unknown LoRA adapter {lora_name!r}; loaded: {sorted(self._lora_paths)}"
            )
        return lora_name
