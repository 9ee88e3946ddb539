"""A vLLM engine in a process of its own: :func:`start_engine_process`.

The program's process keeps :class:`~genlm_backend.llm.AsyncLM` (checks, batching, cache,
sampling from rows) and the tokenizer; the child process starts the ``vllm.LLM`` as
:meth:`.AsyncVirtualLM.from_name` does and runs its engine (:func:`vllm_engine`), sessions
included. Rows arrive on the engine's device. vllm is never imported in the program's process.
"""

from __future__ import annotations

from typing import Any

from ..base import AsyncLM
from ..engine_process import ProcessEngine
from .virtual_lm import DEFAULT_BATCH_SIZE

__all__ = ["start_engine_process", "vllm_engine"]


def start_engine_process(
    model_name: str,
    engine_opts: dict | None = None,
    *,
    sessions: bool | int = True,
    session_idle_batches: int = 8,
    session_hold_s: float = 1.0,
    tokenizer: Any = None,
    **kwargs: Any,
) -> AsyncLM:
    """An :class:`~genlm_backend.llm.AsyncLM` whose vLLM engine runs in a child process.

    Args:
        model_name: a local model folder (or a hub id where the hub can be reached).
        engine_opts: keyword arguments of ``vllm.LLM``, as for
            :meth:`.AsyncVirtualLM.from_name` (same defaults).
        sessions: as for :class:`.AsyncVirtualLM`.
        session_idle_batches: as for :class:`.AsyncVirtualLM`.
        session_hold_s: as for :class:`.AsyncVirtualLM`.
        tokenizer: the Hugging Face tokenizer (default: loaded from ``engine_opts["tokenizer"]``
            or ``model_name``).
        **kwargs: :class:`~genlm_backend.llm.AsyncLM`'s ``batch_size`` (default: the
            engine's ``max_num_seqs``, at least 20), ``timeout``, ``cache_size``,
            ``cache_opts``, ``flush``.

    The child is stopped by ``cleanup()``, and stops by itself when this process ends.

    Raises:
        EngineError: the child could not start the engine (``__cause__``: its error).
    """
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained((engine_opts or {}).get("tokenizer")
                                                  or model_name)
    engine = ProcessEngine(
        vllm_engine, model_name, engine_opts, sessions=sessions,
        session_idle_batches=session_idle_batches, session_hold_s=session_hold_s,
    )
    try:
        batch_size = kwargs.pop("batch_size", None)
        if batch_size is None:
            batch_size = max(engine.max_num_seqs or 0, DEFAULT_BATCH_SIZE)
        return AsyncLM(tokenizer, engine, batch_size=batch_size, **kwargs)
    except BaseException:
        engine.close()
        raise


def vllm_engine(
    model_name: str,
    engine_opts: dict | None,
    *,
    sessions: bool | int,
    session_idle_batches: int,
    session_hold_s: float,
) -> Any:
    """Starts the ``vllm.LLM`` and its :class:`.vllm_engine.VLLMEngine` in this process (the
    child's side of :func:`start_engine_process`)."""
    from .virtual_lm import SAMPLE_BATCH_SIZE, shut_down_on_failure, start_llm
    from .vllm_engine import VLLMEngine

    llm, can_capture = start_llm(model_name, engine_opts)
    with shut_down_on_failure(llm):
        engine = VLLMEngine(
            llm, sample_batch_size=SAMPLE_BATCH_SIZE, timeout=0.02, flush="idle",
            can_capture=can_capture, session_idle_batches=session_idle_batches,
            session_hold_s=session_hold_s,
        )
    engine.set_sessions(sessions)
    return engine
