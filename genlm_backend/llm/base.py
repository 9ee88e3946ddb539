"""`AsyncLM`: the contract every backend offers, composed around an engine.

A backend builds an engine (:class:`~.engine.Engine`: a batch of log-probability requests in,
rows out, plus optional adapters and sampling) and hands it to :class:`AsyncLM`, which owns
the rest: input validation, the batcher, the output cache, adapter names (from
:mod:`.adapters`), the sync twins, default sampling built on log-probabilities (from
:mod:`.default_sampling`), and the lifecycle.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..batching import INLINE, Batcher
from ..cache import OutputCache
from ..exceptions import ClosedError, InvalidRequestError
from ..sync_calls import run_sync
from .adapters import Adapters
from .default_sampling import StepwiseSampling
from .engine import Engine, stops_what_it_started
from .prompts import LogprobsRequest, PromptChecker

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncLM", "LogprobsRequest", "stops_what_it_started"]

class AsyncLM(StepwiseSampling, Adapters):
    """A language model whose next-token log-probabilities are awaited and auto-batched.

    Concurrent awaits of :meth:`next_token_logprobs` become one engine call (see
    :mod:`genlm_backend.batching` for when a batch runs). Identical requests queued together
    are evaluated once. Results are fp32 log-softmax rows over the model's whole output
    vocabulary, on the device the backend computes on.

    Args:
        tokenizer: the Hugging Face tokenizer of the model.
        engine: what evaluates the batches (:class:`~genlm_backend.llm.engine.Engine`).
        batch_size: the most distinct requests evaluated in one engine call.
        timeout: seconds after the first queued request before its batch runs at the latest.
        cache_size: number of log-probability rows kept in the output cache (0: no cache).
        cache_opts: extra keyword arguments of :class:`~genlm_backend.cache.OutputCache`.
        flush: ``"idle"`` (default) also runs a batch as soon as the event loop has nothing
            else ready to run; ``"timer"`` waits for ``timeout`` or a full batch only.

    Attributes:
        tokenizer: the Hugging Face tokenizer.
        engine: the engine.
        byte_vocab: list of :class:`~genlm_backend.tokenization.Token`, index = token id
            (decoded on first use).
        str_vocab: list of str, same indexing.
    """

    def __init__(
        self,
        tokenizer: Any,
        engine: Engine,
        *,
        batch_size: int = 20,
        timeout: float = 0.02,
        cache_size: int = 0,
        cache_opts: dict | None = None,
        flush: str = "idle",
    ):
        self.tokenizer = tokenizer
        self.engine = engine
        self._vocabs: tuple[list, list[str]] | None = None
        self.cache = OutputCache(cache_size, **(cache_opts or {})) if cache_size > 0 else None
        self.num_cache_hits = 0
        self.batch_size = batch_size
        self.timeout = timeout
        # The engine's evaluate is called on the loop: it says itself where its work runs.
        self._logprobs_batcher = Batcher(
            engine.evaluate,
            max_batch_size=batch_size,
            timeout=timeout,
            flush=flush,
            executor=INLINE,
            name=f"{type(self).__name__}.next_token_logprobs",
        )
        self._prompts: PromptChecker | None = None
        self._init_adapters()
        self.is_closed = False

    # ---- what the engine provides ------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """The model's output size V: the length of every log-probability row."""
        self._check_open()
        return self.engine.vocab_size

    @property
    def max_prompt_len(self) -> int | None:
        """The longest prompt the model accepts (tokens), or None for no known limit."""
        self._check_open()
        return self.engine.max_prompt_len

    # ---- vocabularies -----------------------------------------------------------------

    @property
    def byte_vocab(self) -> list:
        """The exact bytes of every token id (list of ``Token``), decoded on first use."""
        self._check_open()
        return self._decoded_vocabs()[0]

    @property
    def str_vocab(self) -> list[str]:
        """The text of every token id, same indexing as :attr:`byte_vocab`."""
        self._check_open()
        return self._decoded_vocabs()[1]

    def _decoded_vocabs(self) -> tuple[list, list[str]]:
        if self._vocabs is None:
            from ..tokenization import decode_vocab

            self._vocabs = decode_vocab(self.tokenizer)
        return self._vocabs

    # ---- log-probabilities ------------------------------------------------------------

    async def next_token_logprobs(
        self, token_ids: Any, lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities of the next token after ``token_ids``; auto-batched: concurrent
        awaits (``asyncio.gather``, tasks, ``TaskGroup``) share one engine call.

        Args:
            token_ids: the prompt, a non-empty sequence of token ids in ``[0, V)``: a list
                or tuple of ints (numpy integers too), a 1-D integer numpy array or tensor.
            lora_name: the adapter for this call; None uses the active one (``set_lora``).

        Returns:
            A float32 tensor ``[V]`` of normalised log-probabilities, the caller's own copy.

        Raises:
            InvalidRequestError: empty prompt, id outside ``[0, V)``, prompt too long,
                unknown adapter (a ``ValueError``).
            InvalidRequestTypeError: token ids that are not integers (a ``TypeError``).
            ClosedError: the model was cleaned up.
            EngineError: the engine failed on this request's batch.
        """
        request = self._request(token_ids, lora_name)
        if self.cache is None:  # the hot path of samplers: the batcher's future, awaited here
            return await self._logprobs_batcher.enqueue(request)
        return await self._logprobs(request, use_cache=True)

    async def batch_next_token_logprobs(
        self, token_ids_list: Iterable[Any], lora_name: str | None = None
    ) -> torch.Tensor:
        """Log-probabilities for several prompts: a tensor ``[N, V]``, row i for prompt i.

        Every prompt is validated before any is queued; the rows are batched with whatever
        else is awaiting the model.
        """
        requests = self._requests(token_ids_list, lora_name)
        if self.cache is None:
            return torch.stack(await self._enqueued(requests))
        rows = await asyncio.gather(*(self._logprobs(r, use_cache=True) for r in requests))
        return torch.stack(rows)

    def next_token_logprobs_sync(
        self, token_ids: Any, lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking :meth:`next_token_logprobs`; works in scripts and inside a running loop."""
        request = self._request(token_ids, lora_name)
        return run_sync(self._logprobs(request, use_cache=True))

    def batch_next_token_logprobs_sync(
        self, token_ids_list: Iterable[Any], lora_name: str | None = None
    ) -> torch.Tensor:
        """Blocking batch of log-probabilities ``[N, V]``; bypasses the output cache."""
        requests = self._requests(token_ids_list, lora_name)

        async def gather() -> list[torch.Tensor]:
            return await self._enqueued(requests)

        return torch.stack(run_sync(gather()))

    def _enqueued(self, requests: list[LogprobsRequest]) -> asyncio.Future:
        """The rows of ``requests``, queued as one future each, gathered without a task
        each (for the ``async def`` methods that await them)."""
        self._check_open()
        enqueue, futures = self._logprobs_batcher.enqueue, []
        try:
            for request in requests:
                futures.append(enqueue(request))
        except BaseException:
            for future in futures:
                future.cancel()
            raise
        return asyncio.gather(*futures)

    async def _logprobs(self, request: LogprobsRequest, *, use_cache: bool) -> torch.Tensor:
        self._check_open()
        if use_cache and self.cache is not None and request in self.cache:
            self.num_cache_hits += 1
            return self.cache[request].clone()
        row = await self._logprobs_batcher.submit(request)
        if use_cache and self.cache is not None:
            self.cache[request] = row.clone()
        return row

    def _request(self, token_ids: Any, lora_name: str | None) -> LogprobsRequest:
        if self.is_closed:
            self._check_open()
        prompts = self._prompts
        if prompts is None:  # on first use: backends know their sizes once their __init__ ran
            prompts = self._prompts = PromptChecker(self.vocab_size, self.max_prompt_len)
        lora = self.active_lora if lora_name is None else self._resolve_lora(lora_name)
        return prompts.request(token_ids, lora)

    def _requests(
        self, token_ids_list: Iterable[Any], lora_name: str | None
    ) -> list[LogprobsRequest]:
        if isinstance(token_ids_list, (str, bytes)) or not isinstance(token_ids_list, Iterable):
            raise InvalidRequestError(
                f"token_ids_list must be a sequence of prompts, got {type(token_ids_list).__name__}"
            )
        requests = [self._request(ids, lora_name) for ids in token_ids_list]
        if not requests:
            raise InvalidRequestError("token_ids_list is empty: pass at least one prompt")
        return requests

    # ---- lifecycle ----------------------------------------------------------------------

    def clear_cache(self) -> None:
        """Empties the output cache."""
        self._check_open()
        if self.cache is not None:
            self.cache.clear()

    def reset_async_queries(self) -> None:
        """Drops every queued request; each dropped awaiter gets ``RequestDroppedError``.

        Requests already being evaluated still complete.
        """
        self._check_open()
        self._logprobs_batcher.reset()

    def stats(self) -> dict[str, Any]:
        """Batching counters of the log-probability path, output-cache hits, and the
        engine's own counters where it has a ``stats()`` method."""
        self._check_open()
        engine_stats = getattr(self.engine, "stats", None)
        return {**self._logprobs_batcher.stats.as_dict(), "cache_hits": self.num_cache_hits,
                **(engine_stats() if engine_stats is not None else {})}

    def cleanup(self) -> None:
        """Fails every waiting request, releases the engine. Idempotent; later use of any
        other public method or property raises ``ClosedError``."""
        if self.is_closed:
            return
        self.is_closed = True
        self._logprobs_batcher.close()
        try:
            self.engine.close()
        finally:
            if self._draw_thread is not None:
                self._draw_thread.shutdown(wait=False)
            if self.cache is not None:
                self.cache.clear()

    def _stop_started(self) -> None:
        """After a failed ``__init__``: stops the parts it made, those that exist."""
        batcher = getattr(self, "_logprobs_batcher", None)
        if batcher is not None:
            batcher.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()

    def _check_open(self) -> None:
        if self.is_closed:
            raise ClosedError(f"this {type(self).__name__} was cleaned up; create a new one")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cleanup()
