"""Forcing tokens in a step: :class:`ForcedSampling` skips vLLM's sampler where every row of
the step is forced (installed by :func:`~genlm_backend.llm.vllm.internals.install_forced_sampling`),
and :func:`force_tokens` forces them in the logits otherwise."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .internals import CHECKED_VERSIONS

__all__ = ["ForcedSampling", "current_forcing", "force_tokens"]

# ``.forcing``: the ForcedSampling of the sampler call running on this thread, if any.
_LOCAL = threading.local()


def current_forcing() -> ForcedSampling | None:
    """The :class:`ForcedSampling` of the sampler call running on this thread, if any."""
    return getattr(_LOCAL, "forcing", None)


class ForcedSampling:
    """Skips vLLM's sampling in a step whose every row is forced (lockstep sampling: every
    row of the step is a held session continued by the next batch).

    Forcing through the logits costs, after the hold, a fill and a scatter over ``[N, V]``,
    vLLM's argmax over the same, and a device-to-host copy of tokens known on the host all
    along. Installed on an engine's sampler and model runner
    (:func:`~genlm_backend.llm.vllm.internals.install_forced_sampling`), this takes the processor's
    forced tokens itself: when they cover every row of an all-greedy step without log-probabilities,
    the sampler's result is those tokens, handed to the device in one copy, and the model
    runner's device-to-host copy of them is the host list; otherwise it forces them in the
    logits as the processor would and vLLM samples as usual. A step whose processor named
    tokens that the sampler never took fails loudly (vLLM changed under it).
    """

    def __init__(self) -> None:
        self.pending: list[tuple[int, int]] | None = None  # (row, token), named this step
        self.host: list[list[int]] | None = None  # this step's tokens, for the runner's copy
        self.num_skipped = 0  # steps sampled without vLLM's sampler

    def wrap_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``Sampler.forward``: the processor's forced tokens come here while it runs."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            outer = getattr(_LOCAL, "forcing", None)
            _LOCAL.forcing = self
            self.pending = self.host = None
            try:
                out = original(*args, **kwargs)
            finally:
                _LOCAL.forcing = outer
                missed, self.pending = self.pending, None
            if missed is not None:
                raise RuntimeError(
                    "vLLM's sampler did not take the forced tokens (Sampler.forward no longer "
                    "calls self.sample after the logits processors): this vLLM differs from "
                    f"{CHECKED_VERSIONS}"
                )
            return out

        return forward

    def wrap_sample(self, original: Callable[..., Any],
                    plain_greedy: Callable[[Any], bool]) -> Callable[..., Any]:
        """``Sampler.sample(logits, sampling_metadata)``; ``plain_greedy(sampling_metadata)``
        tells a step whose every row is greedy and asks for no log-probabilities
        (:func:`~genlm_backend.llm.vllm.internals.plain_greedy`)."""

        def sample(logits: torch.Tensor, metadata: Any, *args: Any, **kwargs: Any) -> Any:
            forced, self.pending = self.pending, None
            if forced is not None:
                if len(forced) == logits.shape[0] and plain_greedy(metadata):
                    tokens = [t for _, t in forced]
                    self.host = [[t] for t in tokens]
                    self.num_skipped += 1
                    return torch.tensor(tokens, dtype=torch.int64, device=logits.device), None
                force_tokens(logits, forced)
            return original(logits, metadata, *args, **kwargs)

        return sample

    def wrap_to_list(
        self, original: Callable[[torch.Tensor], list]
    ) -> Callable[[torch.Tensor], list]:
        """The model runner's ``_to_list(sampled_token_ids [N, 1]) -> [[token], ...]``."""

        def to_list(sampled: torch.Tensor) -> list:
            host, self.host = self.host, None
            if (host is not None and sampled.dim() == 2 and sampled.shape[0] == len(host)
                    and sampled.shape[1] == 1):
                return host
            return original(sampled)

        return to_list


def force_tokens(logits: torch.Tensor, forced: list[tuple[int, int]]) -> None:
    """Makes token ``t`` the only possible one in row ``i`` of ``logits``, for each ``(i, t)``
    of ``forced`` (sorted by row).

    Few torch calls: each costs several times more here, once a step after the hold, than in
    a warm loop (measured on the H100 host: ``torch.tensor`` of two ints 35 us, a ``fill_``
    28 us). The tokens go to the device by one plain copy, made when the step's forward pass
    is done (a pinned buffer's event checks cost more than the wait they would avoid).
    """
    n = len(forced)
    first, last = forced[0][0], forced[-1][0]
    if last - first + 1 == n:  # contiguous (lockstep: usually all rows)
        tokens = torch.tensor([[t] for _, t in forced], dtype=torch.int64, device=logits.device)
        block = logits if n == logits.shape[0] else logits[first : last + 1]
        block.fill_(float("-inf"))
        block.scatter_(1, tokens, 0.0)
    else:
        index, tokens = torch.tensor(
            [[i for i, _ in forced], [t for _, t in forced]], dtype=torch.int64,
            device=logits.device,
        ).unsqueeze(2)
        logits[index.squeeze(1)] = float("-inf")
        logits[index, tokens] = 0.0
