"""``ParallelTokenCharacterTrie``: trie weights as batched tensor operations on any device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..exceptions import InvalidRequestError
from . import _compiled
from ._memory import empty_cpu
from ._plan import flat_plan
from ._weights import WeightsInfo, check_weights
from .character_trie import TokenCharacterTrie

__all__ = ["ParallelTokenCharacterTrie"]

_STRATEGIES = ("auto", "levels", "flat")
# Most tokens below a stage-1 node of the flat strategy (each later stage: times this).
_FLAT_FANIN = 64
# On the CPU, batches of at most this many rows run row by row on the numpy kernels.
_NUMPY_MAX_BATCH = 4
# Largest [B, nnz] gather of the flat strategy, in elements; bigger batches are split.
_MAX_GATHER = 1 << 27


class ParallelTokenCharacterTrie(TokenCharacterTrie):
    """A :class:`TokenCharacterTrie` whose weights are computed with torch, in batches.

    Same nodes, ids and attributes as :class:`TokenCharacterTrie`, same results (up to
    float rounding: sums accumulate in the compute dtype, float32 for float32 weights, in
    a tree order, and on CUDA through atomics, so their last bits may vary from run to
    run; maxima are exact).

    Where it computes: on ``device`` when one is given (``"cpu"``, ``"cuda"``,
    ``"cuda:1"``, ...); with ``device=None`` (the default) on the device of each input
    tensor, and on the CPU for numpy arrays and lists. The trie's index tensors are copied
    to a device once, on first use there.

    What it returns (the same rules as the sequential trie): a tensor input gives a tensor
    on the input's device, with the input's dtype if float32/float64 and float32
    otherwise; a numpy array or list gives a float64 numpy array. Batched results are
    ``[B, num_nodes]``; on the ``levels`` strategy they are the transpose of a node-major
    buffer, so rows are strided views (call ``.contiguous()`` if you need dense rows).

    Strategies (all give the same values; ``"auto"`` picks per device):
        * ``"auto"`` on the CPU uses the compiled kernel ``genlm_backend.trie._kernel``
          when ``pip install`` could build it (see :mod:`~genlm_backend.trie._compiled`):
          one branch-free pass per row straight into a dense ``[B, num_nodes]`` result,
          rows shared out between ``torch.get_num_threads()`` threads (so
          ``OMP_NUM_THREADS`` and ``torch.set_num_threads`` apply), the GIL released.
          Without it, ``"auto"`` on the CPU means
          ``"levels"``, except that batches of at most 4 rows run row by row on the
          sequential trie's numpy kernels (faster, one thread).
        * ``"levels"``: one scatter per depth of the trie, over a node-major
          ``[nodes, B]`` buffer.
        * ``"flat"`` (auto on accelerators): a few gathers and segmented reductions over
          ``[B, items]`` buffers (see :class:`~genlm_backend.trie._plan.FlatPlan`), so the
          number of kernel launches does not grow with the depth of the trie.

    Args:
        decode: the byte vocabulary (see :class:`TokenCharacterTrie`).
        device: where to compute; ``None`` follows the input.
        strategy: ``"auto"``, ``"levels"`` or ``"flat"``.

    Raises:
        InvalidRequestError: an unknown ``strategy``, or an empty ``decode``.
        RuntimeError: ``device`` names a device torch cannot use.
    """

    def __init__(
        self,
        decode: Sequence[Any],
        device: str | torch.device | None = None,
        strategy: str = "auto",
    ):
        if strategy not in _STRATEGIES:
            raise InvalidRequestError(f"strategy must be one of {_STRATEGIES}, got {strategy!r}")
        super().__init__(decode)
        self.strategy = strategy
        self.device = None if device is None else torch.device(device)
        self._flat = None
        self._kernels: dict[tuple[str, str], Any] = {}
        # decided once per trie, so a test or a benchmark can build one without the kernel
        self._use_compiled = strategy == "auto" and _compiled.KERNEL is not None
        if self.device is not None:
            self._kernel_for(self.device)  # fail now if the device is unusable

    # ---- weights ------------------------------------------------------------------------

    def weight_sum(self, ws: Any) -> Any:
        """The total weight below every node: ``[V]`` in, ``[num_nodes]`` out (see the class
        docstring for devices and types). Raises ``ValueError`` for a wrong shape or NaN."""
        return self._run("sum", ws, batched=False)

    def weight_max(self, ws: Any) -> Any:
        """The largest weight below every node (correct for log-weights, ``-inf``
        included): ``[V]`` in, ``[num_nodes]`` out."""
        return self._run("max", ws, batched=False)

    def batch_weight_sum(self, ws: Any) -> Any:
        """:meth:`weight_sum` of each row: ``[B, V]`` in, ``[B, num_nodes]`` out."""
        return self._run("sum", ws, batched=True)

    def batch_weight_max(self, ws: Any) -> Any:
        """:meth:`weight_max` of each row: ``[B, V]`` in, ``[B, num_nodes]`` out."""
        return self._run("max", ws, batched=True)

    def _run(self, op: str, ws: Any, *, batched: bool) -> Any:
        arr, info = check_weights(ws, self.num_leaves, batched=batched)
        device = self.device or (arr.device if info.is_tensor else torch.device("cpu"))
        if (
            device.type == "cpu"
            and self.strategy == "auto"
            and not self._use_compiled
            and (not batched or arr.shape[0] <= _NUMPY_MAX_BATCH)
        ):  # a few rows: the numpy kernels beat a scatter per level, and use one thread
            kernel = self._numpy_kernels.sum if op == "sum" else self._numpy_kernels.max
            return self._run_numpy(kernel, arr, info, batched=batched)
        dtype = info.dtype if info.is_tensor else torch.float64
        weights = torch.as_tensor(arr).to(device=device, dtype=dtype)
        if not batched:
            weights = weights.unsqueeze(0)
        kernel = self._kernel_for(device)
        if weights.shape[0] == 0:
            out = weights.new_empty((0, self.num_nodes))
        else:
            out = kernel.run(op, weights)
        if not batched:
            out = out[0]
        return _deliver(out, info)

    def _kernel_for(self, device: torch.device) -> Any:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"device {str(device)!r} was asked for but CUDA is not available"
                )
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        strategy = self.strategy
        if strategy == "auto":
            if device.type != "cpu":
                strategy = "flat"
            else:
                strategy = "compiled" if self._use_compiled else "levels"
        key = (str(device), strategy)
        kernel = self._kernels.get(key)
        if kernel is None:
            if strategy == "compiled":
                kernel = _compiled.compiled_plan(self._layout)
            elif strategy == "levels":
                kernel = _LevelKernel(self, device)
            else:
                if self._flat is None:
                    self._flat = flat_plan(
                        self._layout, fanin=_FLAT_FANIN, compression=self._plan.compression
                    )
                kernel = _FlatKernel(self, device)
            self._kernels[key] = kernel
        return kernel


def _deliver(out: torch.Tensor, info: WeightsInfo) -> Any:
    if info.is_tensor:
        return out.to(info.device)
    return out.cpu().numpy()


class _LevelKernel:
    """The ``levels`` strategy: one node-major ``[num_nodes, B]`` buffer, filled in place.

    Leaves get the weights (one transposing copy); every internal node starts at the
    neutral value and receives its leaves (one scatter), then each depth, from the deepest,
    is scattered into its parents' rows, which are the contiguous rows of the depth above.
    The result is the transpose of that buffer: no gather to reorder rows at the end.
    """

    def __init__(self, trie: ParallelTokenCharacterTrie, device: torch.device):
        layout = trie._layout
        self.num_internal = layout.num_internal
        self.num_nodes = layout.num_nodes
        self.leaf_parent = torch.as_tensor(layout.leaf_parent, device=device)
        starts = layout.level_starts.tolist()
        self.levels = []
        for d in range(layout.max_depth - 1, -1, -1):
            start, stop, child_stop = starts[d], starts[d + 1], starts[d + 2]
            parents = layout.parent[stop:child_stop] - start
            self.levels.append((start, stop, child_stop, torch.as_tensor(parents, device=device)))

    def run(self, op: str, weights: torch.Tensor) -> torch.Tensor:
        batch = weights.shape[0]
        if weights.device.type == "cpu":
            out = empty_cpu((self.num_nodes, batch), weights.dtype)
        else:
            out = torch.empty((self.num_nodes, batch), dtype=weights.dtype, device=weights.device)
        internal, leaves = out[: self.num_internal], out[self.num_internal :]
        leaves.copy_(weights.T)
        internal.fill_(0.0 if op == "sum" else float("-inf"))
        _combine(op, internal, self.leaf_parent, leaves)
        for start, stop, child_stop, parents in self.levels:
            _combine(op, out[start:stop], parents, out[stop:child_stop])
        return out.T


def _combine(op: str, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[index[i]] (+)= src[i]`` row-wise, with sum or max as the combining operation."""
    rows = index.unsqueeze(1).expand(-1, src.shape[1])
    if op == "sum":
        dst.scatter_add_(0, rows, src)
    else:
        dst.scatter_reduce_(0, rows, src, "amax")


class _FlatKernel:
    """The ``flat`` strategy: per stage one gather and one scatter into that stage's values,
    over a ``[B, leaves + values]`` pool; the result is one final ``[B, num_nodes]`` gather.

    No step synchronises with the host and the number of launches is fixed by the number
    of stages (3 for a 131k vocabulary), not by the depth of the trie. On CUDA the scatter
    uses atomics, so float sums may differ in the last bits from run to run.
    """

    def __init__(self, trie: ParallelTokenCharacterTrie, device: torch.device):
        plan = trie._flat
        comp = plan.compression
        self.num_items = trie.num_leaves
        self.num_real = comp.num_real
        self.stages = []
        for start, gather, lengths in plan.stages:
            segment = np.repeat(np.arange(len(lengths)), lengths)
            self.stages.append(
                (
                    self.num_items + start,
                    len(lengths),
                    torch.as_tensor(gather, device=device),
                    torch.as_tensor(segment, device=device),
                )
            )
        self.max_nnz = max(len(gather) for _, gather, _ in plan.stages)
        self.pick = torch.cat(
            [
                torch.as_tensor(comp.node_to_value, device=device) + self.num_items,
                torch.arange(self.num_items, device=device),
            ]
        )

    def run(self, op: str, weights: torch.Tensor) -> torch.Tensor:
        step = max(1, _MAX_GATHER // max(1, self.max_nnz))
        if weights.shape[0] > step:
            return torch.cat([self.run(op, part) for part in weights.split(step)])
        batch = weights.shape[0]
        pool = torch.empty(
            (batch, self.num_items + self.num_real), dtype=weights.dtype, device=weights.device
        )
        pool[:, : self.num_items] = weights
        fill = 0.0 if op == "sum" else float("-inf")
        for first, count, gather, segment in self.stages:
            picked = pool.index_select(1, gather)
            values = pool[:, first : first + count]
            values.fill_(fill)
            index = segment.expand(batch, -1)
            if op == "sum":
                values.scatter_add_(1, index, picked)
            else:
                values.scatter_reduce_(1, index, picked, "amax")
        return pool.index_select(1, self.pick)
