"""The engine protocol: what a backend gives :class:`~genlm_backend.llm.AsyncLM`.

:class:`AsyncLM` is one class that every backend composes: it validates requests, batches
concurrent awaits, keeps the output cache, offers the sync twins and samples by awaited rows;
for the rows themselves it calls an *engine*, an object that follows :class:`Engine`. To plug
in a backend of your own, write an engine and hand it over::

    class MyEngine(ThreadedEngine):
        def __init__(self, model):
            super().__init__("my-engine")  # its batches run on a thread of its own
            self.model, self.vocab_size, self.max_prompt_len = model, model.vocab_size, None

        def evaluate_batch(self, requests):  # on the engine's thread
            return [self.model.logprobs(r.token_ids) for r in requests]

    lm = AsyncLM(tokenizer, MyEngine(model), batch_size=8)

An engine may add optional capabilities: adapters (:class:`AdapterEngine`) and its own
sampler (:class:`SamplingEngine`); :class:`AsyncLM` uses them where they are there.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ..engine_thread import EngineThread, TurnLock
from ..exceptions import ClosedError
from .prompts import LogprobsRequest

__all__ = [
    "AdapterEngine",
    "Engine",
    "EngineAttribute",
    "SamplingEngine",
    "ThreadedEngine",
    "stops_what_it_started",
]


@runtime_checkable
class Engine(Protocol):
    """A batch of log-probability requests in, one row per request out.

    Attributes:
        vocab_size: the model's output size V, the length of every row.
        max_prompt_len: the longest prompt (tokens) the model accepts, or None.
    """

    vocab_size: int
    max_prompt_len: int | None

    def evaluate(self, requests: list[LogprobsRequest]) -> Sequence[Any] | asyncio.Future:
        """Evaluates one batch of distinct requests (:class:`~.prompts.LogprobsRequest`:
        ``token_ids``, ``lora_name``), each checked already.

        Called on the event loop's thread. The engine decides where the work runs: it returns
        the results at once (work that does not block the loop), or an ``asyncio.Future`` of
        this loop that it resolves with them (work done elsewhere, e.g. on its own thread:
        :class:`ThreadedEngine`). The results: one fp32 log-softmax row ``[V]`` per request,
        in order, or an exception instance in place of a row, which fails that request's
        callers only. An exception raised (or set on the future) fails the whole batch.
        """
        ...

    def close(self) -> None:
        """Releases the engine; called once, by :meth:`AsyncLM.cleanup`, from any thread.
        A batch in flight may still finish or fail; later batches are not asked for."""
        ...


@runtime_checkable
class AdapterEngine(Protocol):
    """Optional: an engine that runs requests with adapters (LoRA), by name.

    :class:`AsyncLM` keeps the names, ids and the active adapter; a request's ``lora_name``
    is one loaded here (or None: the base model). An engine without these methods refuses
    adapters.
    """

    def load_adapter(self, name: str, path: str, adapter_id: int) -> None:
        """Makes the adapter in folder ``path`` usable as ``name`` (``adapter_id``: its
        integer id, :meth:`AsyncLM.hash_to_int`). Blocks; raises on a bad adapter."""
        ...

    def unload_adapter(self, name: str) -> None:
        """Releases adapter ``name``; requests for it that are still queued fail each alone."""
        ...


@runtime_checkable
class SamplingEngine(Protocol):
    """Optional: an engine with a sampler of its own, used by :meth:`AsyncLM.sample` in
    place of sampling one awaited row at a time."""

    async def sample(
        self,
        request: LogprobsRequest,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        temperature: float,
        seed: int | None,
        options: dict[str, Any],
    ) -> list[int] | list[list[int]]:
        """Samples a continuation of ``request.token_ids`` (arguments checked already;
        ``options``: engine-specific keywords, refused with ``InvalidRequestError`` where
        unknown). Stops after ``max_tokens`` tokens or before the first id in
        ``eos_token_ids``, which is not returned. Called on the event loop."""
        ...


def stops_what_it_started(init: Callable[..., None]) -> Callable[..., None]:
    """Wraps an ``__init__`` (of a model or an engine): when it raises, what it started so
    far (threads, batchers) is stopped by its ``_stop_started()`` before the error goes on.
    A model or engine it was given is left as it is: it is the caller's."""

    @functools.wraps(init)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            self._stop_started()
            raise

    return wrapped


class ThreadedEngine:
    """A base for engines whose batches run on one thread of their own (off the event loop).

    Subclasses set ``vocab_size`` and ``max_prompt_len`` and write :meth:`evaluate_batch`;
    :meth:`run` runs other work on the same thread, so it never overlaps a batch.

    Args:
        name: the thread's name.
        lock: a :class:`~genlm_backend.engine_thread.TurnLock` the thread holds while it
            works, shared by engines whose calls must not overlap (None: none).
    """

    vocab_size: int
    max_prompt_len: int | None = None

    def __init__(self, name: str, lock: TurnLock | None = None):
        self.thread = EngineThread(name, lock)

    def evaluate(self, requests: list[LogprobsRequest]) -> asyncio.Future:
        """On the event loop: hands the batch to the engine's thread (:meth:`evaluate_batch`)."""
        try:
            job = self.thread.submit(self.evaluate_batch, requests)
        except RuntimeError as exc:  # the thread was shut down under us
            raise ClosedError(f"the engine was closed: {exc}") from exc
        return asyncio.wrap_future(job)

    def evaluate_batch(self, requests: list[LogprobsRequest]) -> Sequence[Any]:
        """On the engine's thread: one row (or exception instance) per request, in order."""
        raise NotImplementedError

    def run(self, work: Callable[..., Any], *args: Any) -> Any:
        """Runs ``work(*args)`` on the engine's thread and waits for its result (blocking)."""
        return self.thread.submit(work, *args).result()

    def close(self) -> None:
        """Stops the thread: queued batches are cancelled (their callers get ``ClosedError``),
        the one running finishes."""
        self.thread.shutdown(wait=False, cancel_futures=True)


class EngineAttribute:
    """An attribute of a model front that is its engine's attribute of the same name (read
    and assigned through ``front.engine``), e.g. ``model = EngineAttribute()``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, front: Any, owner: type | None = None) -> Any:
        return self if front is None else getattr(front.engine, self.name)

    def __set__(self, front: Any, value: Any) -> None:
        setattr(front.engine, self.name, value)
