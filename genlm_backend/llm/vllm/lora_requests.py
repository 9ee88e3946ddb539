"""LoRA adapters of :class:`~genlm_backend.llm.vllm.AsyncVirtualLM`: loading, removing, and the
requests whose adapter was removed before they ran."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...exceptions import InvalidRequestError
from ..prompts import LogprobsRequest

if TYPE_CHECKING:
    from .runner import RowBatch

__all__ = ["LoRAMixin"]


class LoRAMixin:
    """The adapter handling of ``AsyncVirtualLM`` (``self._lora_requests`` maps a loaded
    adapter's name to its ``LoRARequest``)."""

    def _with_adapters(
        self, requests: list[LogprobsRequest], batch: RowBatch
    ) -> list[LogprobsRequest | None]:
        """``requests``, with None for those whose adapter was removed since they were queued:
        their slots of ``batch`` get the error; the rest of the batch runs."""
        loaded = self._lora_requests
        if not any(r.lora_name is not None and r.lora_name not in loaded for r in requests):
            return requests
        kept: list[LogprobsRequest | None] = list(requests)
        for i, request in enumerate(requests):
            if request.lora_name is not None and request.lora_name not in loaded:
                batch.set(i, _removed_lora(request.lora_name))
                kept[i] = None
        return kept

    def _load_lora(self, lora_name: str, lora_path: str) -> None:
        from vllm.lora.request import LoRARequest

        from . import internals

        if not os.path.isdir(lora_path):
            raise InvalidRequestError(f"LoRA adapter folder {lora_path!r} does not exist")
        if not getattr(self.llm.llm_engine.vllm_config, "lora_config", None):
            raise InvalidRequestError(
                "this engine was started without LoRA support: pass "
                "engine_opts={'enable_lora': True, 'max_lora_rank': R} to from_name"
            )
        engine = self.llm.llm_engine
        refusal = internals.lora_refusal(engine)
        if refusal is None:  # vLLM's CPU ops would give base-model rows the last adapter slot
            refusal = self._engine_thread.submit(internals.install_lora_base_rows, engine).result()
        if refusal is not None:
            raise InvalidRequestError(refusal)
        request = LoRARequest(lora_name, self.hash_to_int(lora_name), lora_path)
        self._engine_thread.submit(self.llm.llm_engine.add_lora, request).result()
        self._lora_requests[lora_name] = request

    def _unload_lora(self, lora_name: str) -> None:
        if self.is_closed:
            self._lora_requests.pop(lora_name, None)
            return
        self._engine_thread.submit(self._forget_lora, lora_name).result()

    def _forget_lora(self, lora_name: str) -> None:
        """On the engine thread, so between two batches: a batch planned before runs with the
        adapter; requests that name it later fail, each on its own (:meth:`_with_adapters`,
        :meth:`_check_lora`)."""
        request = self._lora_requests.pop(lora_name, None)
        if request is not None:
            self._sessions.close_where(lambda s: s.lora_name == lora_name)
            self.llm.llm_engine.remove_lora(request.lora_int_id)

    def _lora_request(self, lora_name: str | None) -> Any:
        if lora_name is None:
            return None
        request = self._lora_requests.get(lora_name)
        if request is None:
            raise _removed_lora(lora_name)
        return request

    def _check_lora(self, lora_request: Any) -> InvalidRequestError | None:
        """Before a job's request goes to the engine: an adapter removed since the job was
        made fails it (vLLM would load the adapter again from its folder, under its id)."""
        if self._lora_requests.get(lora_request.lora_name) is lora_request:
            return None
        return _removed_lora(lora_request.lora_name)


def _removed_lora(lora_name: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {lora_name!r} was removed before this request ran")
