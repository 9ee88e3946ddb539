"""Drawing tokens from log-probability rows, with concurrent draws batched like model calls.

A particle that samples its next token from the row it awaited pays for a few kernel
launches and one device-to-host copy; on a GPU that is tens of microseconds per particle,
per step, which at 64+ particles costs as much as the model's own decode step. A
:class:`TokenSampler` shared by the particles turns the draws that are awaited together into
one batched draw over the stacked rows: one set of kernels and one copy for the whole step.

The draw is exact: the exponential race (``argmax_i log p_i - log E_i`` with independent
``E_i ~ Exp(1)``, i.e. the Gumbel-max trick) picks token ``i`` with probability ``p_i``.

Rows of one model batch: the backends hand out the rows of a batch as views of one
``[k, V]`` tensor. On a GPU, the first draw from any of them draws a token for every row of
that block at once, and later draws from its other rows return their token without waiting
for a batch (no future, no extra turn of the event loop). Each pre-drawn token is handed
out once; a row drawn from again, or a block changed in place since (its version counter
moved), is drawn afresh, so every draw stays an independent exact draw from the row as it
is when it is asked for.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from .batching import INLINE, Batcher

__all__ = ["TokenSampler"]


class _Draw:
    """One awaited draw (compared by identity: two draws from equal rows stay two draws)."""

    __slots__ = ("row",)

    def __init__(self, row: torch.Tensor):
        self.row = row


class _Block:
    """The tokens drawn for every row of one block, each handed out once."""

    __slots__ = ("base", "version", "offset", "stride", "row_shape", "tokens", "left")

    def __init__(self, ref: weakref.ref, base: torch.Tensor, tokens: list[int]):
        self.base, self.version = ref, base._version
        self.offset = base.storage_offset()
        self.stride, self.row_shape = base.stride(0), base.shape[1:]
        self.tokens: list[int | None] = list(tokens)
        self.left = len(tokens)


# Blocks whose rows may still be asked for; the oldest is forgotten first.
_MAX_BLOCKS = 8


class TokenSampler:
    """Samples token ids from log-probability rows; draws awaited together run as one batch.

    Args:
        seed: seeds the generator of each device (None: nondeterministic).
        max_batch_size: the most draws in one batch, as for
            :class:`~genlm_backend.batching.Batcher`.
        timeout: seconds after the first queued draw before its batch runs at the latest
            (it usually runs sooner: as soon as the event loop has nothing else to do).
        predraw: draw every row of a block at the first draw from one of them (see the
            module docstring). None (default): on accelerators, not on the CPU.

    Rows are 1-D tensors of (possibly unnormalised) log-probabilities; ``-inf`` entries are
    never drawn. Rows of one batch are grouped by device, length and dtype.
    """

    def __init__(
        self,
        seed: int | None = None,
        *,
        max_batch_size: int = 4096,
        timeout: float = 0.02,
        predraw: bool | None = None,
    ):
        self.seed = seed
        # None: pre-draw blocks on accelerators only (on a CPU a block's draw costs as much
        # as its rows' draws, and drawing rows nobody asks for would be waste).
        self.predraw = predraw
        self._generators: dict[torch.device, torch.Generator] = {}
        self._blocks: dict[int, _Block] = {}
        self.num_predrawn = 0
        self._batcher = Batcher(
            self._draw_batch, max_batch_size=max_batch_size, timeout=timeout, executor=INLINE,
            name="TokenSampler",
        )

    async def sample(self, logprobs: torch.Tensor) -> int:
        """One token id drawn from ``softmax(logprobs)``; batched with concurrent calls.

        Raises:
            ValueError: ``logprobs`` is not a non-empty 1-D floating-point tensor, or all
                of it is ``-inf`` (for this caller only).
        """
        if type(logprobs) is not torch.Tensor:
            return await self._batcher.submit(_Draw(_check_row(logprobs)))
        base = logprobs._base
        if base is not None:
            token = self._predrawn(logprobs, base)
            if token is not None:
                return token
        return await self._batcher.submit(_Draw(_check_row(logprobs)))

    def _predrawn(self, row: torch.Tensor, base: torch.Tensor) -> int | None:
        """The pre-drawn token of ``row`` when it is a whole row of the block ``base``; None
        when it is not (or its token was handed out already: the caller then draws afresh)."""
        key = base.data_ptr()  # not id(): id() runs every audit hook (filelock installs one)
        block = self._blocks.get(key)
        if block is None or block.base() is not base or block.version != base._version:
            if not (self.predraw or (self.predraw is None and base.device.type != "cpu")):
                return None
            if (
                base.dim() != 2
                or base.stride(1) != 1
                or not base.is_floating_point()
                or base.shape[1] == 0
            ):
                return None
            if row.shape != base.shape[1:] or (
                row.storage_offset() - base.storage_offset()
            ) % base.stride(0):
                return None  # not a whole row of the block: nothing to draw the block for
            try:
                tokens = self._draw_rows(base)
            except ValueError:  # an all -inf row in the block: draw row by row
                return None
            block = self._remember_block(key, base, tokens)
        index, rest = divmod(row.storage_offset() - block.offset, block.stride)
        if (
            rest
            or not 0 <= index < len(block.tokens)
            or row.shape != block.row_shape
            or not row.is_contiguous()
        ):
            return None
        token = block.tokens[index]
        if token is not None:
            block.tokens[index] = None
            block.left -= 1
            if block.left == 0 and self._blocks.get(key) is block:
                del self._blocks[key]
            self.num_predrawn += 1
        return token

    def _remember_block(self, key: int, base: torch.Tensor, tokens: list[int]) -> _Block:
        blocks = self._blocks

        def forget(ref: weakref.ref) -> None:  # the block's tensor is gone
            if key in blocks and blocks[key].base is ref:
                del blocks[key]

        block = blocks[key] = _Block(weakref.ref(base, forget), base, tokens)
        while len(blocks) > _MAX_BLOCKS:
            del blocks[next(iter(blocks))]
        return block

    def sample_now(self, logprobs: torch.Tensor) -> int:
        """One draw, unbatched (same distribution, same generator)."""
        return self._draw_rows(_check_row(logprobs).unsqueeze(0))[0]

    @property
    def stats(self) -> Any:
        """The batcher's counters (``num_batches``, ``mean_batch_size``, ...)."""
        return self._batcher.stats

    def _draw_batch(self, draws: Sequence[_Draw]) -> list[Any]:
        try:  # the usual case: rows of one length on one device, one stack, one draw
            return self._draw_rows(torch.stack([d.row for d in draws]))
        except (RuntimeError, ValueError):  # lengths or devices differ, or an all -inf row
            pass
        results: list[Any] = [None] * len(draws)
        groups: dict[tuple, list[int]] = {}
        for i, draw in enumerate(draws):
            row = draw.row
            groups.setdefault((row.device, row.shape[0], row.dtype), []).append(i)
        for members in groups.values():
            rows = torch.stack([draws[i].row for i in members])
            try:
                tokens = self._draw_rows(rows)
            except ValueError as exc:  # an all -inf row: find it, draw the others
                tokens = (
                    [self._draw_one(draws[i].row) for i in members] if len(members) > 1 else [exc]
                )
            for i, token in zip(members, tokens):
                results[i] = token
        return results

    def _draw_one(self, row: torch.Tensor) -> Any:
        try:
            return self._draw_rows(row.unsqueeze(0))[0]
        except ValueError as exc:
            return exc

    def _draw_rows(self, rows: torch.Tensor) -> list[int]:
        noise = torch.empty(rows.shape, dtype=torch.float32, device=rows.device)
        noise.exponential_(generator=self._generator(rows.device))
        # A zero draw would give a -inf token a +inf key; E < 1e-38 has probability 1e-38.
        keys = rows.float() - noise.clamp_min_(torch.finfo(torch.float32).tiny).log_()
        best = keys.max(dim=-1)
        tokens = torch.where(torch.isneginf(best.values), -1, best.indices).tolist()  # one copy
        if min(tokens) < 0:
            raise ValueError("cannot sample from a row whose log-probabilities are all -inf")
        return tokens

    def _generator(self, device: torch.device) -> torch.Generator:
        generator = self._generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            if self.seed is None:
                generator.seed()
            else:
                generator.manual_seed(self.seed)
            self._generators[device] = generator
        return generator


def _check_row(logprobs: Any) -> torch.Tensor:
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 1 or logprobs.numel() == 0:
        raise ValueError(
            f"expected a non-empty 1-D tensor of log-probabilities, got {logprobs!r:.80}"
        )
    if not logprobs.is_floating_point():
        raise ValueError(f"log-probabilities must be floating point, got {logprobs.dtype}")
    return logprobs
