"""``AsyncTokenCharacterTrie``: concurrent ``await weight_sum(ws)`` calls, batched."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..batching import Batcher, BatcherStats
from ..exceptions import EngineError, InvalidRequestError, InvalidRequestTypeError
from ._weights import check_weights
from .character_trie import TokenCharacterTrie
from .parallel import ParallelTokenCharacterTrie

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["AsyncTokenCharacterTrie"]

_BACKENDS = ("parallel", "sequential")


class _Request:
    """One awaited call; hashes by identity, so no two requests are ever merged."""

    __slots__ = ("op", "weights")

    def __init__(self, op: str, weights: Any):
        self.op = op
        self.weights = weights

    def group(self) -> tuple:
        """Requests that can be stacked into one batch share this key."""
        w = self.weights
        if isinstance(w, torch.Tensor):
            return (self.op, "torch", str(w.device), str(w.dtype))
        return (self.op, "numpy", None, str(w.dtype))


class AsyncTokenCharacterTrie:
    """Batches concurrent ``weight_sum`` / ``weight_max`` awaits into ``batch_weight_*`` calls.

    Every ``await weight_sum(ws)`` is checked at once (a bad ``ws`` raises ``ValueError`` to
    that caller only, before anything is queued), then queued in the project's
    :class:`~genlm_backend.batching.Batcher`: the queued requests run together as soon as
    the event loop has nothing else ready, ``max_batch_size`` are queued, or ``timeout``
    seconds pass. The batch runs on a worker thread, so the loop stays responsive. Requests
    with the same operation, array type, device and dtype are stacked into one call; each
    caller gets its own row (tensor in, tensor out on the same device; numpy or list in,
    float64 numpy out: the rules of the wrapped trie). If the trie raises, the callers of
    that stack get an :class:`~genlm_backend.exceptions.EngineError` whose ``__cause__`` is
    the trie's error, and later calls run as usual.

    Args:
        trie: a :class:`TokenCharacterTrie` or :class:`ParallelTokenCharacterTrie`
            (reachable afterwards as ``.trie``).
        max_batch_size: most requests evaluated together.
        timeout: seconds a request waits at most for its batch to fill.

    Raises:
        InvalidRequestTypeError: ``trie`` has no ``batch_weight_sum`` / ``batch_weight_max``.
    """

    def __init__(
        self, trie: TokenCharacterTrie, *, max_batch_size: int = 64, timeout: float = 0.02
    ):
        if not all(hasattr(trie, m) for m in ("batch_weight_sum", "batch_weight_max")):
            raise InvalidRequestTypeError(
                f"trie must be a TokenCharacterTrie or ParallelTokenCharacterTrie, got "
                f"{type(trie).__name__}"
            )
        self.trie = trie
        self._batcher = Batcher(
            self._evaluate, max_batch_size=max_batch_size, timeout=timeout, name="trie"
        )

    @classmethod
    def from_vocab(
        cls,
        vocab: Sequence[Any],
        backend: str = "parallel",
        *,
        max_batch_size: int = 64,
        timeout: float = 0.02,
        **trie_opts: Any,
    ) -> AsyncTokenCharacterTrie:
        """Builds the trie of ``vocab`` and wraps it.

        Args:
            vocab: the byte vocabulary (see :class:`TokenCharacterTrie`).
            backend: ``"parallel"`` (:class:`ParallelTokenCharacterTrie`, default) or
                ``"sequential"`` (:class:`TokenCharacterTrie`).
            max_batch_size: most requests evaluated together.
            timeout: seconds a request waits at most for its batch to fill.
            **trie_opts: passed to the trie (e.g. ``device="cuda"`` for the parallel one).

        Raises:
            InvalidRequestError: an unknown ``backend``.
        """
        if backend == "parallel":
            trie: TokenCharacterTrie = ParallelTokenCharacterTrie(vocab, **trie_opts)
        elif backend == "sequential":
            trie = TokenCharacterTrie(vocab, **trie_opts)
        else:
            raise InvalidRequestError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        return cls(trie, max_batch_size=max_batch_size, timeout=timeout)

    async def weight_sum(self, ws: Any) -> Any:
        """``trie.weight_sum(ws)``, evaluated in a batch with concurrent calls.

        Raises:
            InvalidRequestError: ``ws`` has the wrong shape or length, or a NaN.
            InvalidRequestTypeError: ``ws`` is not an array of real numbers.
            ClosedError: after :meth:`cleanup`.
            EngineError: the trie failed on this request's batch.
        """
        return await self._submit("sum", ws)

    async def weight_max(self, ws: Any) -> Any:
        """``trie.weight_max(ws)`` (log-weights welcome, ``-inf`` included), batched like
        :meth:`weight_sum`."""
        return await self._submit("max", ws)

    async def _submit(self, op: str, ws: Any) -> Any:
        arr, _ = check_weights(ws, self.trie.num_leaves, batched=False)
        if not isinstance(arr, torch.Tensor) and arr.dtype.kind != "f":
            arr = arr.astype(np.float64)
        return await self._batcher.submit(_Request(op, arr))

    def _evaluate(self, requests: list[_Request]) -> list[Any]:
        results: list[Any] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(request.group(), []).append(i)
        for (op, kind, _, _), members in groups.items():
            rows = [requests[i].weights for i in members]
            stacked = torch.stack(rows) if kind == "torch" else np.stack(rows)
            method = self.trie.batch_weight_sum if op == "sum" else self.trie.batch_weight_max
            try:
                out = method(stacked)
            except Exception as exc:  # noqa: BLE001 - handed to this stack's callers only
                for i in members:
                    error = EngineError(f"the trie failed on a batch of {len(members)}: {exc!r}")
                    error.__cause__ = exc
                    results[i] = error
                continue
            for row, i in enumerate(members):
                results[i] = out[row]
        return results

    @property
    def stats(self) -> BatcherStats:
        """Counters of the batcher (requests, batches, mean batch size, time spent)."""
        return self._batcher.stats

    def shutdown(self) -> None:
        """Stops batching: queued and running awaiters get ``ClosedError``, later calls raise
        it. Idempotent."""
        self._batcher.close()

    async def cleanup(self) -> None:
        """Async twin of :meth:`shutdown`, for ``await sampler.cleanup()``-style callers."""
        self.shutdown()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
