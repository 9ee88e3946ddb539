"""Fresh output buffers backed by transparent huge pages where Linux allows it.

A ``[64, num_nodes]`` float32 result of a 131k vocabulary is ~100 MB of fresh memory per
call. With 4 KiB pages, first-touch page faults can cost as much as the computation that
fills the buffer; advising huge pages before the first touch makes them few
(``benchmarks/README.md``). This is advice only (``madvise(MADV_HUGEPAGE)``, the
same call PyTorch makes when ``THP_MEM_ALLOC_ENABLE=1``): where it is unavailable (not
Linux, no glibc, THP disabled) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import numpy as np
import torch

__all__ = ["empty_cpu"]

_HUGE_PAGE = 1 << 21
_MIN_BYTES = 4 * _HUGE_PAGE
_MADV_HUGEPAGE = 14


def _load_madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


def _advise(address: int, num_bytes: int) -> None:
    if _madvise is None or num_bytes < _MIN_BYTES:
        return
    start = (address + _HUGE_PAGE - 1) & ~(_HUGE_PAGE - 1)
    stop = (address + num_bytes) & ~(_HUGE_PAGE - 1)
    if stop > start:
        _madvise(start, stop - start, _MADV_HUGEPAGE)  # advice: a failure changes nothing


def empty_cpu(shape: tuple[int, ...], dtype, *, like: str = "torch"):
    """An uninitialised CPU tensor (``like="torch"``) or ndarray (``like="numpy"``) whose
    large allocations are advised to use huge pages before anything touches them."""
    if like == "numpy":
        out = np.empty(shape, dtype=dtype)
        _advise(out.ctypes.data, out.nbytes)
        return out
    out = torch.empty(shape, dtype=dtype)
    _advise(out.data_ptr(), out.numel() * out.element_size())
    return out
