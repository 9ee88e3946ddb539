"""Checks of what callers pass, raised before a request is queued (so only they see it)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..exceptions import InvalidRequestError, InvalidRequestTypeError

__all__ = [
    "MAX_SEED",
    "check_eos_token_ids",
    "check_max_tokens",
    "check_seed",
    "check_temperature",
    "check_token_ids",
    "one_or_many_prompts",
]

MAX_SEED = 2**63 - 1
"""The largest seed: vLLM keeps a seed as a signed 64-bit int (and reads -1 as no seed)."""


def check_token_ids(
    token_ids: Any,
    vocab_size: int,
    max_len: int | None,
    *,
    allow_empty: bool = False,
) -> tuple[int, ...]:
    """Returns ``token_ids`` as a tuple of Python ints, or raises naming the bad value.

    Accepts a list or tuple of ints (numpy integers too), a 1-D integer numpy array or
    torch tensor.

    Raises:
        InvalidRequestTypeError: not a sequence, or an element that is not an integer
            (bools and floats included).
        InvalidRequestError: empty, an id outside ``[0, vocab_size)``, longer than ``max_len``.
    """
    ids = _as_int_tuple(token_ids)
    if not ids and not allow_empty:
        raise InvalidRequestError("empty prompt: token_ids must hold at least one token id")
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # in C; find the culprit on error only
        for position, tid in enumerate(ids):
            if not 0 <= tid < vocab_size:
                raise InvalidRequestError(
                    f"token id {tid!r} at position {position} is outside the vocabulary "
                    f"of size {vocab_size}"
                )
    if max_len is not None and len(ids) > max_len:
        raise InvalidRequestError(
            f"prompt of {len(ids)} tokens is longer than the model's limit of {max_len} tokens"
        )
    return ids


def _as_int_tuple(token_ids: Any) -> tuple[int, ...]:
    if type(token_ids) is list or type(token_ids) is tuple:
        # The common case, plain ints, checked in C: type() excludes bool and numpy integers,
        # which take the element-wise path below (isinstance per id costs ~2 us a token).
        ids = tuple(token_ids)
        if set(map(type, ids)) <= {int}:
            return ids
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
            raise InvalidRequestTypeError(
                f"token_ids must be a 1-D integer array, got shape {token_ids.shape} "
                f"dtype {token_ids.dtype}"
            )
        return tuple(token_ids.tolist())
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (list, tuple, range)):
        raise InvalidRequestTypeError(
            f"token_ids must be a list of ints, got {type(token_ids).__name__}: {token_ids!r:.80}"
        )
    ids = []
    for position, tid in enumerate(token_ids):
        if isinstance(tid, bool) or not isinstance(tid, numbers.Integral):
            raise InvalidRequestTypeError(
                f"token id {tid!r} at position {position} is not an int ({type(tid).__name__})"
            )
        ids.append(int(tid))
    return tuple(ids)


def check_max_tokens(max_tokens: Any) -> int:
    """Raises unless ``max_tokens`` is a positive int."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral):
        raise InvalidRequestTypeError(f"max_tokens must be an int, got {max_tokens!r}")
    if max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {max_tokens!r}")
    return int(max_tokens)


def check_temperature(temperature: Any) -> float:
    """Raises unless ``temperature`` is a finite number >= 0."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise InvalidRequestTypeError(f"temperature must be a number, got {temperature!r}")
    if not (0 <= temperature < float("inf")):
        raise InvalidRequestError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def check_seed(seed: Any, num_seeds: int = 1) -> int | None:
    """Returns ``seed`` as an int (None stays None), or raises naming it.

    A seed is an int in ``[0, MAX_SEED]`` (``2**63 - 1``), the same on every backend;
    ``num_seeds`` consecutive seeds from ``seed`` must all be (``batch_sample`` seeds prompt
    i with ``seed + i``).

    Raises:
        InvalidRequestTypeError: neither None nor an int (bools and floats included).
        InvalidRequestError: a seed outside the range.
    """
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise InvalidRequestTypeError(f"seed must be an int or None, got {seed!r}")
    seed = int(seed)
    last = seed + num_seeds - 1
    if seed < 0 or last > MAX_SEED:
        which = "" if num_seeds == 1 else f" (seeds {seed} to {last}, one per prompt)"
        raise InvalidRequestError(f"seed {seed}{which} is outside [0, 2**63 - 1]")
    return seed


def check_eos_token_ids(eos_token_ids: Any, vocab_size: int) -> frozenset[int]:
    """The stop ids of a sampling call: None (no stop id), one id (an int, a numpy integer,
    a 0-d integer array or tensor) or any collection of ids in a form
    :func:`check_token_ids` takes (or a set); raises as it does."""
    if eos_token_ids is None:
        return frozenset()
    ids = eos_token_ids
    if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
        ids = [ids]
    elif isinstance(ids, (torch.Tensor, np.ndarray)):
        ids = ids.reshape(-1) if ids.ndim == 0 else ids
    elif isinstance(ids, Iterable) and not isinstance(ids, (str, bytes, list, tuple, range)):
        ids = list(ids)  # a set, a generator
    return frozenset(check_token_ids(ids, vocab_size, None, allow_empty=True))


def one_or_many_prompts(prompts: Any) -> Any:
    """``prompts`` as a collection of prompts: one prompt, in any form
    :func:`check_token_ids` takes, becomes a list of it; anything else is taken as a
    collection of prompts (2-D arrays and tensors by row) and left to the checks."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        return [prompts] if prompts.ndim <= 1 else list(prompts)
    if isinstance(prompts, (list, tuple, range)) and len(prompts) > 0:
        first = prompts[0]
        if not isinstance(first, (list, tuple, range)) and getattr(first, "ndim", 0) < 1:
            return [prompts]
    return prompts
