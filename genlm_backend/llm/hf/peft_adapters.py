"""LoRA adapters of the transformers engine (:mod:`.transformer_engine`), through peft:
loading, removing, and running a request with its adapter active."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from ...exceptions import InvalidRequestError

__all__ = ["PeftAdapters"]


class PeftAdapters:
    """The adapter capability of ``TransformerEngine`` (``self.model`` becomes a peft model
    once an adapter is loaded; ``self.lock`` guards it)."""

    def load_adapter(self, lora_name: str, lora_path: str, adapter_id: int) -> None:
        try:
            from peft import PeftModel
        except ImportError as exc:  # pragma: no cover - peft is a dev dependency
            raise ImportError("LoRA adapters need peft: pip install 'genlm-backend[lora]'") from exc
        with self.lock:
            try:
                if self._has_adapters:
                    self.model.load_adapter(lora_path, adapter_name=lora_name)
                else:
                    self.model = PeftModel.from_pretrained(
                        self.model, lora_path, adapter_name=lora_name
                    )
            except (OSError, ValueError) as exc:
                raise InvalidRequestError(
                    f"cannot load a LoRA adapter from {lora_path!r}: {exc}"
                ) from exc
            self.model.eval()
            self._has_adapters = True

    def unload_adapter(self, lora_name: str) -> None:
        with self.lock:
            self.kv.clear_adapter(lora_name)
            if len(self.model.peft_config) <= 1:  # the last one: back to the plain model
                self.model = self.model.unload()
                self._has_adapters = False
            else:
                with warnings.catch_warnings():  # "adapter X was active ... now deleted"
                    warnings.simplefilter("ignore", UserWarning)
                    self.model.delete_adapter(lora_name)

    def _removed_adapter(self, lora_name: str | None) -> InvalidRequestError | None:
        """The error of a request for adapter ``lora_name`` that the model no longer has
        (removed after the request was checked), or None. Call under ``lock``."""
        if lora_name is None or (self._has_adapters and lora_name in self.model.peft_config):
            return None
        return InvalidRequestError(
            f"LoRA adapter {lora_name!r} was removed before this request ran"
        )

    @contextlib.contextmanager
    def adapter(self, lora_name: str | None) -> Iterator[None]:
        """Runs the body with adapter ``lora_name`` active (None: the base model).

        Raises:
            InvalidRequestError: the adapter was removed (never the base model instead).
        """
        removed = self._removed_adapter(lora_name)
        if removed is not None:
            raise removed
        if not self._has_adapters:
            yield
            return
        if lora_name is None:
            with self.model.disable_adapter():
                yield
            return
        if self.model.active_adapter != lora_name:
            self.model.set_adapter(lora_name)
        yield
