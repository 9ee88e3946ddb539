"""How the Hugging Face backend turns a batch of prompts into few forward passes.

Each prompt becomes a :class:`Step`: the deepest prefix whose key/value states the trie holds
(``num_cached`` tokens, read from ``source``) and the tokens still to run (``num_new``).
:func:`plan_chunks` groups steps into forward passes and :func:`run_chunk` runs one:

* the cached states of the rows are right-aligned in a common width (a row with a shorter
  prefix is padded at the front, and the padding is masked out);
* the new tokens are right-padded to a common length; padding after a row's last token
  cannot influence it (attention is causal), so no mask is needed for it;
* every row gets its true positions (``num_cached + j``), so rotary and absolute position
  embeddings see what an unpadded forward pass would;
* logits are computed only at the rows' last positions (``logits_to_keep``; all positions
  for a model whose forward pass does not take it), then a float32 log-softmax.

Lockstep particles (each prompt = a previous prompt + one token) thus cost one forward pass
of one token per row, resumed from the previous pass's states without copying them when
the rows come in the same order; the new states are stored back in the trie as one block.
A chunk is kept when its padding stays small: padded new tokens at most twice the real ones
(plus 64), padded cached positions at most four times the real ones (plus 4096), at most
``max_forward_tokens`` new tokens, and at most 256 MiB of logits kept beyond one row per prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .kv_cache import cache_argument, make_past, read_past, returned_cache
from .kvtrie import KVBlock, KVSource, KVTrie, gather_past

__all__ = ["Step", "make_step", "plan_chunks", "run_chunk", "shared_prefixes"]

MAX_LOGITS_BYTES = 1 << 28


@dataclass(eq=False)
class Step:
    """One prompt to run: ``token_ids[num_cached:end]`` on top of the cached states."""

    __slots__ = ("end", "node", "num_cached", "num_new", "slot", "source", "token_ids")

    slot: int  # where its row goes in the batch's results (-1: nowhere)
    token_ids: tuple[int, ...]
    end: int
    node: Any  # the trie node of the cached prefix
    source: KVSource | None
    num_cached: int
    num_new: int


def make_step(
    kv: KVTrie, adapter: Hashable, slot: int, token_ids: tuple[int, ...], *, wants_logits: bool
) -> Step:
    """Looks up the longest cached prefix; at least the last token runs when logits are wanted."""
    end = len(token_ids)
    node, source = kv.lookup(adapter, token_ids, end - 1 if wants_logits else end)
    num_cached = source.length if source is not None else 0
    return Step(slot, token_ids, end, node, source, num_cached, end - num_cached)


def shared_prefixes(steps: Sequence[Step], min_saved: int = 8) -> list[tuple[int, ...]]:
    """Uncached prefixes that several steps of one batch share (to run once, before them).

    Two steps share the longest common prefix of their prompts; a prefix is returned when it
    saves a step at least ``min_saved`` new tokens. Steps with few new tokens (lockstep
    particles) are skipped without looking at their prompts.
    """
    candidates = sorted((s for s in steps if s.num_new > min_saved), key=lambda s: s.token_ids)
    shared: dict[int, int] = {}
    for a, b in itertools.pairwise(candidates):
        length = _common_prefix_length(a.token_ids, b.token_ids)
        for step in (a, b):
            shared[id(step)] = max(shared.get(id(step), 0), length)
    prefixes = set()
    for step in candidates:
        length = shared.get(id(step), 0)
        if length - step.num_cached >= min_saved:
            prefixes.add(step.token_ids[:length])
    return sorted(prefixes)


def _common_prefix_length(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Binary search on slice equality: O(n log n) element comparisons, all in C."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def plan_chunks(
    steps: Sequence[Step], *, vocab_size: int, max_forward_tokens: int, keeps_logits: bool
) -> list[list[Step]]:
    """Groups steps of one adapter into forward passes (see the module docstring).

    All steps in one pass when they fit (the common case); otherwise steps are taken longest
    first and each joins the current pass while that still fits.
    """
    limits = (vocab_size, max_forward_tokens, keeps_logits)
    order = [s for s in steps if s.num_new > 0]
    if not order or _Totals.of(order).fits(*limits):
        return [order] if order else []
    order.sort(key=lambda s: (-s.num_new, -s.num_cached))
    chunks: list[list[Step]] = []
    current: list[Step] = []
    totals = _Totals()
    for step in order:
        grown = totals.plus(step)
        if current and not grown.fits(*limits):
            chunks.append(current)
            current, grown = [], _Totals().plus(step)
        current.append(step)
        totals = grown
    chunks.append(current)
    return chunks


@dataclass(frozen=True)
class _Totals:
    """The sizes of a planned forward pass that its limits are checked on."""

    n: int = 0
    sum_new: int = 0
    sum_all: int = 0
    max_new: int = 0
    max_cached: int = 0
    new_lengths: frozenset = frozenset()

    @classmethod
    def of(cls, steps: Sequence[Step]) -> _Totals:
        return cls(
            len(steps),
            sum(s.num_new for s in steps),
            sum(s.end for s in steps),
            max(s.num_new for s in steps),
            max(s.num_cached for s in steps),
            frozenset(s.num_new for s in steps),
        )

    def plus(self, step: Step) -> _Totals:
        return _Totals(
            self.n + 1,
            self.sum_new + step.num_new,
            self.sum_all + step.end,
            max(self.max_new, step.num_new),
            max(self.max_cached, step.num_cached),
            self.new_lengths | {step.num_new},
        )

    def fits(self, vocab_size: int, max_forward_tokens: int, keeps_logits: bool) -> bool:
        n, padded_new = self.n, self.n * self.max_new
        num_kept = len(self.new_lengths) if keeps_logits else self.max_new
        return (
            padded_new <= max(2 * self.sum_new, self.sum_new + 64)
            and n * (self.max_cached + self.max_new) <= 4 * self.sum_all + 4096
            and (padded_new <= max_forward_tokens or n == 1)
            and n * (num_kept - 1) * vocab_size * 4 <= MAX_LOGITS_BYTES
        )


def run_chunk(
    model: Any,
    kv: KVTrie,
    adapter: Hashable,
    steps: list[Step],
    *,
    device: torch.device,
    keeps_logits: bool,
) -> list[tuple[Step, torch.Tensor]]:
    """Runs one forward pass, stores its states in ``kv``; returns each step's fp32
    log-probabilities.

    Rows are ordered by source block so that each block is read once per layer.
    """
    steps = sorted(steps, key=_by_source)
    width = max(s.num_cached for s in steps)
    num_new = max(s.num_new for s in steps)
    past, is_padded = gather_past([s.source for s in steps], width)
    kwargs = _inputs(steps, width, num_new, is_padded, device)
    pick = _logits_to_keep(steps, num_new, keeps_logits, kwargs, device)

    kwargs[cache_argument(model)] = make_past(past)
    out = model(use_cache=True, **kwargs)
    logits = out.logits
    if pick is None:
        logits = logits[:, -1]
    else:
        logits = logits[torch.arange(len(steps), device=logits.device), pick.to(logits.device)]
    logprobs = logits.float().log_softmax(dim=-1)

    offsets = [width - s.num_cached for s in steps]
    block = KVBlock(read_past(returned_cache(out)), offsets, adapter)
    for source_block in {
        id(s.source.block): s.source.block for s in steps if s.source is not None
    }.values():
        kv.touch(source_block)
    kv.add_block(block)
    for row, s in enumerate(steps):
        kv.insert(s.node, s.token_ids, s.end, block, row)
    return list(zip(steps, logprobs.unbind(0)))


def _by_source(step: Step) -> tuple[int, int, int]:
    source = step.source
    return (0, 0, 0) if source is None else (1, id(source.block), source.row)


def _inputs(
    steps: list[Step], width: int, num_new: int, is_padded: bool, device: torch.device
) -> dict[str, Any]:
    """``input_ids``, ``position_ids`` and, for padded past states, ``attention_mask``."""
    if num_new == 1:  # lockstep: one new token per row
        ids = [[s.token_ids[s.num_cached]] for s in steps]
        positions = [[s.num_cached] for s in steps]
    else:
        ids, positions = [], []
        for s in steps:
            new = s.token_ids[s.num_cached : s.end]
            ids.append([*new, *([0] * (num_new - len(new)))])
            # Padding repeats the last true position, so it never exceeds the model's limit.
            last = s.end - 1
            positions.append([min(s.num_cached + j, last) for j in range(num_new)])
    input_ids, position_ids = torch.tensor([ids, positions]).to(device).unbind(0)
    kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids}
    if is_padded:
        mask = torch.ones((len(steps), width + num_new), dtype=torch.long)
        for i, s in enumerate(steps):
            mask[i, : width - s.num_cached] = 0
        kwargs["attention_mask"] = mask.to(device)
    return kwargs


def _logits_to_keep(
    steps: list[Step],
    num_new: int,
    keeps_logits: bool,
    kwargs: dict[str, Any],
    device: torch.device,
) -> torch.Tensor | None:
    """Sets ``logits_to_keep`` in ``kwargs``; returns, per row, which kept position is its last.

    None means the last kept position for every row.
    """
    last = [s.num_new - 1 for s in steps]
    distinct = sorted(set(last))
    if not keeps_logits:
        return torch.tensor(last)
    if distinct == [num_new - 1]:
        kwargs["logits_to_keep"] = 1
        return None
    kwargs["logits_to_keep"] = torch.tensor(distinct, device=device)
    where = {position: k for k, position in enumerate(distinct)}
    return torch.tensor([where[p] for p in last])
