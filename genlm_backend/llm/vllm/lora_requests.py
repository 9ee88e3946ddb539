"""LoRA adapters of the vLLM engine: loading, removing, and the requests whose adapter was
removed before they ran."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...engine_thread import EngineThread
from ...exceptions import InvalidRequestError
from ..prompts import LogprobsRequest

if TYPE_CHECKING:
    from .runner import RowBatch
    from .session_pool import SessionPool

__all__ = ["LoRARequests"]


class LoRARequests:
    """The adapters loaded into one engine, by name (each a ``LoRARequest``).

    Args:
        llm: the ``vllm.LLM``.
        thread: its engine thread (adapters are added and removed between two batches).
        sessions: its session pool (a removed adapter's sessions are closed).
    """

    def __init__(self, llm: Any, thread: EngineThread, sessions: SessionPool):
        self._llm, self._thread, self._sessions = llm, thread, sessions
        self.loaded: dict[str, Any] = {}

    def with_adapters(
        self, requests: list[LogprobsRequest], batch: RowBatch
    ) -> list[LogprobsRequest | None]:
        """``requests``, with None for those whose adapter was removed since they were queued:
        their slots of ``batch`` get the error; the rest of the batch runs."""
        loaded = self.loaded
        if not any(r.lora_name is not None and r.lora_name not in loaded for r in requests):
            return requests
        kept: list[LogprobsRequest | None] = list(requests)
        for i, request in enumerate(requests):
            if request.lora_name is not None and request.lora_name not in loaded:
                batch.set(i, _removed_lora(request.lora_name))
                kept[i] = None
        return kept

    def load(self, lora_name: str, lora_path: str, adapter_id: int) -> None:
        """Adds the adapter in folder ``lora_path`` to the engine as ``lora_name`` (blocks)."""
        from vllm.lora.request import LoRARequest

        from . import internals

        if not os.path.isdir(lora_path):
            raise InvalidRequestError(f"LoRA adapter folder {lora_path!r} does not exist")
        engine = self._llm.llm_engine
        if not getattr(engine.vllm_config, "lora_config", None):
            raise InvalidRequestError(
                "this engine was started without LoRA support: pass "
                "engine_opts={'enable_lora': True, 'max_lora_rank': R} to from_name"
            )
        refusal = internals.lora_refusal(engine)
        if refusal is None:  # vLLM's CPU ops would give base-model rows the last adapter slot
            refusal = self._thread.submit(internals.install_lora_base_rows, engine).result()
        if refusal is not None:
            raise InvalidRequestError(refusal)
        request = LoRARequest(lora_name, adapter_id, lora_path)
        self._thread.submit(engine.add_lora, request).result()
        self.loaded[lora_name] = request

    def unload(self, lora_name: str) -> None:
        """Removes adapter ``lora_name`` from the engine (blocks)."""
        self._thread.submit(self._forget, lora_name).result()

    def _forget(self, lora_name: str) -> None:
        """On the engine thread, so between two batches: a batch planned before runs with the
        adapter; requests that name it later fail, each on its own (:meth:`with_adapters`,
        :meth:`check`)."""
        request = self.loaded.pop(lora_name, None)
        if request is not None:
            self._sessions.close_where(lambda s: s.lora_name == lora_name)
            self._llm.llm_engine.remove_lora(request.lora_int_id)

    def request(self, lora_name: str | None) -> Any:
        """The ``LoRARequest`` of ``lora_name`` (None for the base model).

        Raises:
            InvalidRequestError: the adapter was removed.
        """
        if lora_name is None:
            return None
        request = self.loaded.get(lora_name)
        if request is None:
            raise _removed_lora(lora_name)
        return request

    def check(self, lora_request: Any) -> InvalidRequestError | None:
        """Before a job's request goes to the engine: an adapter removed since the job was
        made fails it (vLLM would load the adapter again from its folder, under its id)."""
        if self.loaded.get(lora_request.lora_name) is lora_request:
            return None
        return _removed_lora(lora_request.lora_name)


def _removed_lora(lora_name: str) -> InvalidRequestError:
    return InvalidRequestError(f"LoRA adapter {lora_name!r} was removed before this request ran")
