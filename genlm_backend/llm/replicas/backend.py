"""`ReplicatedLM`: one :class:`~genlm_backend.llm.base.AsyncLM` over several replicas of a model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ...exceptions import ClosedError, InvalidRequestError
from ..base import AsyncLM, LogprobsRequest, stops_what_it_started
from .building import build_replicas
from .gathering import Gathering
from .routing import Router

__all__ = ["ReplicatedLM"]

# Keyword arguments of from_name that are the wrapper's own; the rest go to every replica.
_OWN_OPTIONS = ("batch_size", "timeout", "cache_size", "cache_opts", "flush", "balance_margin", "device")


class ReplicatedLM(AsyncLM):
    """One model served by several replicas: k backends of the same model, each on its own
    GPU (or group of GPUs), for programs with more particles than one engine serves.

    It is an :class:`~genlm_backend.llm.base.AsyncLM` itself: concurrent awaits of
    :meth:`next_token_logprobs` are validated, deduplicated, cached (``cache_size``) and
    batched here, once; each batch is split over the replicas by
    :class:`~genlm_backend.llm.replicas.routing.Router` and every replica evaluates its share
    as one batch of its own (its engine sessions and prefix cache at work), all replicas at
    the same time. Routing: a context that extends by one token a context evaluated recently
    (a particle's next step, and every child of a resampled particle) goes to the replica
    that evaluated that context, where its prefix is cached and its engine session lives;
    a replica that would get more than ``ceil(n / k * balance_margin)`` of a batch's ``n``
    requests gives up its excess over an even share to the least loaded replicas (children
    of a context that another request extends already first); new contexts go to the
    least loaded replica.

    Rows are each replica's own rows (equal to what that replica returns alone), on one
    device: ``device`` if given, else the device of replica 0's rows; rows computed on
    another device are moved there (without waiting, on a GPU), so ``torch.stack`` of every
    particle's row works. A replica that fails fails only the requests routed to it. The
    replicas belong to this object: :meth:`cleanup` cleans every one of them (LoRA adapters,
    :meth:`clear_cache` and :meth:`reset_async_queries` also reach all of them). Call the
    replicas directly only for what this class does not offer.

    Args:
        replicas: the backends (at least one, distinct, open), on the same tokenizer and
            output size, e.g. :class:`~genlm_backend.llm.vllm.AsyncVirtualLM` instances;
            :meth:`from_name` builds them.
        batch_size: the most distinct requests in one batch of the wrapper; None: the sum
            of the replicas' batch sizes.
        timeout: seconds after the first queued request before its batch runs at the latest.
        cache_size: log-probability rows kept in the output cache (0: no cache), here once
            for every replica.
        cache_opts: extra keyword arguments of :class:`~genlm_backend.cache.OutputCache`.
        flush: ``"idle"`` (default) or ``"timer"``, as for :class:`~genlm_backend.llm.base.AsyncLM`.
        balance_margin: how far above an even share one replica's share of a batch may go
            before it is evened out (>= 1.0; 1.0: every batch is split evenly, the fastest
            where particles share their prompt).
        device: the device every row is returned on; None: replica 0's.

    Raises:
        InvalidRequestError: no replicas, a replica that is not an ``AsyncLM``, closed or
            given twice, or replicas whose vocabularies differ (a ``ValueError``).
    """

    @stops_what_it_started
    def __init__(
        self,
        replicas: Sequence[AsyncLM],
        *,
        batch_size: int | None = None,
        timeout: float = 0.02,
        cache_size: int = 0,
        cache_opts: dict | None = None,
        flush: str = "idle",
        balance_margin: float = 1.0,
        device: str | torch.device | None = None,
    ):
        replicas = tuple(replicas)
        _check_replicas(replicas)
        if batch_size is None:
            batch_size = sum(int(r.batch_size) for r in replicas)
        super().__init__(
            replicas[0].tokenizer, batch_size=batch_size, timeout=timeout, cache_size=cache_size,
            cache_opts=cache_opts, flush=flush,
        )
        self.replicas = replicas
        self._vocab_size = replicas[0].vocab_size
        limits = [r.max_prompt_len for r in replicas if r.max_prompt_len is not None]
        self._max_prompt_len = min(limits) if limits else None
        self._router = Router(len(replicas), balance_margin, remember=max(4096, 4 * batch_size))
        self.device = _normalise(device)
        self._num_sampling = [0] * len(replicas)  # samples in flight, per replica
        self.num_samples = [0] * len(replicas)

    @classmethod
    def from_name(
        cls,
        model_name: str,
        replicas: int = 2,
        backend: str = "vllm",
        engine_opts: dict | None = None,
        devices: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> ReplicatedLM:
        """Builds ``replicas`` backends on ``model_name`` and serves them as one model.

        With vLLM (the default), every replica is an engine in a process of its own
        (:class:`~genlm_backend.llm.replicas.process.ProcessReplica`, with the caller's
        options: its model in that process, held sessions): engines in one process would
        take turns, since vLLM keeps a model's forward context in one process-wide variable
        and their Python would share one interpreter lock. On a GPU each replica gets
        ``tensor_parallel_size`` (times ``pipeline_parallel_size``) GPUs of its own, the next
        ones of ``devices``, its process's only visible ones. vLLM's own data parallelism is
        not used: its offline ``LLM`` refuses ``data_parallel_size > 1`` in one process (0.32:
        "not supported for single-process usage"). One replica is an engine in this process.
        While replicas in processes live, this process's startup heap is frozen for Python's
        collector (see :func:`~genlm_backend.llm.replicas.process.start_replicas`).

        Args:
            model_name: the model (a local folder or a hub id).
            replicas: how many replicas.
            backend: ``"vllm"``, ``"hf"`` (each replica on its own GPU where there are
                GPUs) or ``"mock"``.
            engine_opts: vLLM's engine options, for every replica (see
                :meth:`AsyncVirtualLM.from_name <genlm_backend.llm.vllm.AsyncVirtualLM.from_name>`).
            devices: this process's CUDA device indices to place replicas on, in order
                (default: all).
            **kwargs: ``batch_size``, ``timeout``, ``cache_size``, ``cache_opts``,
                ``flush``, ``balance_margin`` and ``device`` are this class's; the rest go
                to every replica's ``from_name`` (e.g. ``sessions``, ``hf_opts``).

        Raises:
            InvalidRequestError: an unknown backend or options replicas cannot run with.
            ValueError: fewer GPUs than the replicas need.
        """
        own = {key: kwargs.pop(key) for key in _OWN_OPTIONS if key in kwargs}
        built, home = build_replicas(model_name, replicas, backend, engine_opts, devices, kwargs)
        own.setdefault("device", home)
        try:
            return cls(built, **own)
        except BaseException:
            for lm in built:
                lm.cleanup()
            raise

    # ---- what AsyncLM needs -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_prompt_len(self) -> int | None:
        return self._max_prompt_len

    def _decoded_vocabs(self) -> tuple[list, list[str]]:
        return self.replicas[0]._decoded_vocabs()

    _evaluates_on_loop = True  # the shares go to the replicas from the loop

    def _evaluate_logprobs(self, requests: list[LogprobsRequest]) -> Any:
        """On the event loop: routes the batch, starts every replica's share at once;
        returns the rows (a future of them while replicas work)."""
        shares: list[list[int]] = [[] for _ in self.replicas]
        for i, replica in enumerate(self._router.route(requests)):
            shares[replica].append(i)
        return Gathering(self, requests, shares).start()

    def _start_share(self, index: int, requests: list[LogprobsRequest], loop: asyncio.AbstractEventLoop) -> Any:
        """Replica ``index``'s share of a batch, as one batch of that replica (bypassing its
        own batcher and cache: requests were deduplicated and looked up here)."""
        replica = self.replicas[index]
        if replica.is_closed:
            raise ClosedError(f"replica {index} was cleaned up")
        if replica._evaluates_on_loop:
            return replica._evaluate_logprobs(requests)
        return asyncio.wrap_future(replica._engine_thread.submit(replica._evaluate_logprobs, requests), loop=loop)

    # ---- sampling -------------------------------------------------------------------------

    async def sample(
        self,
        prompt_token_ids: Any,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        **options: Any,
    ) -> Any:
        """Samples a continuation on the replica with the fewest samples in flight.

        Args and result: the replica's ``sample`` (``options`` such as ``lora_name=``, and
        vLLM's sampling options, go to it). Same seed and prompt, same result on any
        replica, as far as the replicas' kernels agree.
        """
        self._check_open()
        index = min(range(len(self.replicas)), key=self._num_sampling.__getitem__)
        self._num_sampling[index] += 1
        self.num_samples[index] += 1
        try:
            return await self.replicas[index].sample(
                prompt_token_ids, max_tokens, eos_token_ids, temperature, seed, **options
            )
        finally:
            self._num_sampling[index] -= 1

    async def batch_sample(
        self,
        prompt_token_ids_list: Iterable[Any],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
        **options: Any,
    ) -> list[Any]:
        """One :meth:`sample` per prompt, spread over the replicas; prompt i uses seed
        ``seed + i`` (as every backend's ``batch_sample`` does)."""
        prompts = [r.token_ids for r in self._requests(prompt_token_ids_list, options.get("lora_name"))]
        return list(await asyncio.gather(*(
            self.sample(p, max_tokens, eos_token_ids, temperature, None if seed is None else seed + i, **options)
            for i, p in enumerate(prompts)
        )))

    # ---- adapters: on every replica ------------------------------------------------------

    def _load_lora(self, lora_name: str, lora_path: str) -> None:
        loaded: list[AsyncLM] = []
        try:
            for replica in self.replicas:
                replica.add_new_lora(lora_path, lora_name)
                loaded.append(replica)
        except BaseException:
            for replica in loaded:  # all replicas or none; the load's own error is the one to see
                with contextlib.suppress(Exception):
                    replica.remove_lora(lora_name)
            raise

    def _unload_lora(self, lora_name: str) -> None:
        _on_every(self.replicas, lambda r: lora_name in r._lora_paths and r.remove_lora(lora_name))

    def set_lora(self, lora_path: str | None = None, lora_name: str = "lora_1") -> None:
        """Activates a loaded adapter for every call that names none, on every replica.

        Raises:
            InvalidRequestError: no adapter named ``lora_name`` was loaded (``add_new_lora``).
        """
        super().set_lora(lora_path, lora_name)
        for replica in self.replicas:
            replica.set_lora(lora_path, lora_name)

    def clear_lora(self) -> None:
        """Deactivates the active adapter, on every replica."""
        super().clear_lora()
        for replica in self.replicas:
            replica.clear_lora()

    # ---- lifecycle -------------------------------------------------------------------------

    def clear_cache(self) -> None:
        """Empties the output cache, and every replica's."""
        super().clear_cache()
        for replica in getattr(self, "replicas", ()):
            replica.clear_cache()

    def reset_async_queries(self) -> None:
        """Drops every queued request, here and in every replica (awaiters get an error).

        Requests already being evaluated still complete.
        """
        super().reset_async_queries()
        for replica in self.replicas:
            replica.reset_async_queries()

    def stats(self) -> dict[str, Any]:
        """Batching and cache counters of this model, routing counters and each replica's own.

        Keys: this model's log-probability batcher counters and ``cache_hits`` at the top
        level; ``routing``: ``num_routed``, ``num_kept`` (sent where their context or their
        parent's went), ``num_moved`` (moved for balance), ``num_new`` (no known route),
        ``num_rows`` (per replica: requests sent) and ``num_samples`` (per replica: samples);
        ``replicas``: each replica's ``stats()`` (its engine and session counters; its
        batcher's count only what was sent to the replica directly).
        """
        return {
            **super().stats(),
            "routing": {**self._router.stats(), "num_samples": list(self.num_samples)},
            "replicas": [replica.stats() for replica in self.replicas],
        }

    def _close(self) -> None:
        """Cleans every replica, each even where another fails; then raises the first failure."""
        _on_every(self.replicas, lambda r: r.cleanup())


def _on_every(replicas: Sequence[AsyncLM], action: Any) -> None:
    """``action(replica)`` on every replica, also after one fails; then raises the first error."""
    errors = []
    for replica in replicas:
        try:
            action(replica)
        except Exception as exc:  # noqa: BLE001 - the others still get theirs
            errors.append(exc)
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"another replica failed as well: {other!r}")
        raise errors[0]


def _normalise(device: str | torch.device | None) -> torch.device | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _check_replicas(replicas: tuple) -> None:
    if not replicas:
        raise InvalidRequestError("ReplicatedLM needs at least one replica")
    for i, replica in enumerate(replicas):
        if not isinstance(replica, AsyncLM):
            raise InvalidRequestError(f"replica {i} is a {type(replica).__name__}, not an AsyncLM")
        if replica.is_closed:
            raise InvalidRequestError(f"replica {i} was cleaned up")
    if len({id(r) for r in replicas}) != len(replicas):
        raise InvalidRequestError("a replica is given twice: pass distinct backends")
    first = replicas[0]
    for i, replica in enumerate(replicas[1:], start=1):
        if replica.vocab_size != first.vocab_size:
            raise InvalidRequestError(
                f"replica {i} has an output size of {replica.vocab_size}, replica 0 of {first.vocab_size}: "
                "replicas must be the same model"
            )
        if replica.tokenizer is not first.tokenizer and _vocabulary(replica.tokenizer) != _vocabulary(first.tokenizer):
            raise InvalidRequestError(f"replica {i}'s tokenizer differs from replica 0's: replicas must be the same model")


def _vocabulary(tokenizer: Any) -> Any:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return get_vocab() if callable(get_vocab) else len(tokenizer)
