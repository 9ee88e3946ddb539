"""Checking weight vectors and choosing the type of results, shared by every trie.

Result rules (the same for every trie class):
    * a ``torch.Tensor`` in gives a ``torch.Tensor`` out, on the input's device, with the
      input's dtype when that is float32 or float64 and float32 otherwise;
    * anything else (numpy array, list, tuple) gives a ``numpy.ndarray`` of float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..exceptions import InvalidRequestError, InvalidRequestTypeError

__all__ = ["WeightsInfo", "check_weights", "to_numpy", "wrap_result"]

_TORCH_RESULT_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class WeightsInfo:
    """Where the result of one request goes: tensor or numpy, device, dtype."""

    is_tensor: bool
    device: torch.device | None
    dtype: Any  # torch.dtype for tensors, numpy dtype otherwise

    def group_key(self) -> tuple:
        return (self.is_tensor, str(self.device), str(self.dtype))


def check_weights(ws: Any, num_items: int, *, batched: bool) -> tuple[Any, WeightsInfo]:
    """Validates ``ws`` and returns it (as a tensor or ndarray) with its result rules.

    Args:
        ws: ``[V]`` (or ``[B, V]`` when ``batched``) weights: tensor, ndarray, list or tuple.
        num_items: V, the length of the vocabulary.
        batched: whether a batch dimension is expected.

    Raises:
        InvalidRequestError: wrong number of dimensions, wrong length, or a NaN.
        InvalidRequestTypeError: not an array of real numbers.
    """
    what = "batch of weights [B, V]" if batched else "weights [V]"
    ndim = 2 if batched else 1
    if isinstance(ws, torch.Tensor):
        if ws.is_complex():
            raise InvalidRequestTypeError(f"{what} must be real numbers, got dtype {ws.dtype}")
        arr: Any = ws.detach()
        info = WeightsInfo(
            True,
            ws.device,
            ws.dtype if ws.dtype in _TORCH_RESULT_DTYPES else torch.float32,
        )
    else:
        try:
            arr = np.asarray(ws)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestTypeError(f"{what} must be an array of numbers: {exc}") from exc
        if arr.dtype.kind not in "biuf":
            raise InvalidRequestTypeError(
                f"{what} must be real numbers, got {type(ws).__name__} of dtype {arr.dtype}"
            )
        info = WeightsInfo(False, None, np.dtype(np.float64))
    shape = tuple(arr.shape)
    if len(shape) != ndim:
        raise InvalidRequestError(
            f"{what} must have {ndim} dimension{'s' if ndim > 1 else ''}, got shape {shape}"
        )
    if shape[-1] != num_items:
        raise InvalidRequestError(
            f"{what} has {shape[-1]} weights but the vocabulary has {num_items} tokens"
        )
    if _has_nan(arr):
        raise InvalidRequestError(f"{what} contains NaN")
    return arr, info


def _has_nan(arr: Any) -> bool:
    # A maximum is NaN exactly when some element is: one reduction, no boolean temporary.
    # CPU tensors are checked through numpy: a torch reduction would wake torch's thread
    # pool on the caller's thread (the event loop's, for the async trie).
    if isinstance(arr, torch.Tensor):
        if not arr.is_floating_point() or arr.numel() == 0:
            return False
        if arr.device.type == "cpu" and arr.dtype in _TORCH_RESULT_DTYPES:
            arr = arr.resolve_conj().resolve_neg().numpy()
        else:
            return bool(torch.isnan(arr.max()))
    return arr.dtype.kind == "f" and arr.size > 0 and bool(np.isnan(arr.max()))


def to_numpy(arr: Any) -> np.ndarray:
    """A CPU ndarray of float32 or float64 with the values of a checked tensor or ndarray
    (no copy when it already is one)."""
    if isinstance(arr, torch.Tensor):
        if arr.dtype not in _TORCH_RESULT_DTYPES:
            arr = arr.to(torch.float32 if arr.dtype.itemsize <= 2 else torch.float64)
        return arr.cpu().resolve_conj().resolve_neg().numpy()
    if arr.dtype in (np.float32, np.float64):
        return arr
    return arr.astype(np.float64)


def wrap_result(values: np.ndarray, info: WeightsInfo) -> Any:
    """Turns a numpy result into the type ``info`` asks for."""
    if not info.is_tensor:
        return values.astype(np.float64, copy=False)
    return torch.from_numpy(values).to(device=info.device, dtype=info.dtype)
