"""Sampling shared by every backend: a continuation drawn one awaited log-probability row at
a time, each draw on a thread of the model's own.

:class:`~genlm_backend.llm.base.AsyncLM` mixes this in; where its engine has a sampler of its
own (:class:`~.engine.SamplingEngine`, vLLM's), the checked request goes to that instead.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterable
from typing import Any

import torch

from ..engine_thread import EngineThread
from ..exceptions import InvalidRequestError
from .validation import check_eos_token_ids, check_max_tokens, check_seed, check_temperature

__all__ = ["StepwiseSampling"]

_DRAW_THREAD_LOCK = threading.Lock()


class StepwiseSampling:
    """The sampling methods of the contract. Expects ``engine``, ``next_token_logprobs``,
    ``_request``, ``_requests``, ``_check_open`` and ``vocab_size`` from the class it is
    mixed into."""

    async def sample(
        self,
        prompt_token_ids: Any,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[int]:
        """Samples a continuation of ``prompt_token_ids``, one awaited step at a time.

        Each step awaits :meth:`next_token_logprobs` (so concurrent samplers share batches)
        and draws from ``softmax(logprobs / temperature)`` with a CPU generator seeded by
        ``seed``, on a thread of the model's own (off the event loop); temperature 0 is
        greedy. Stops after ``max_tokens`` tokens or at the first token whose id is in
        ``eos_token_ids``, which is not returned. Where the engine has a sampler of its own
        (:class:`~genlm_backend.llm.engine.SamplingEngine`), that samples instead.

        Args:
            prompt_token_ids: the prompt, in any form :meth:`next_token_logprobs` takes.
            eos_token_ids: one id or a collection of ids (None: no stop id).
            seed: an int in ``[0, 2**63 - 1]``, or None for a random seed.

        Returns:
            The sampled token ids. Same seed and prompt, same result.

        Raises:
            InvalidRequestError, InvalidRequestTypeError: a bad argument, before anything is
                queued (only this caller gets it).
        """
        return await self._sample(
            prompt_token_ids, max_tokens, eos_token_ids, temperature, seed, None, {}
        )

    async def _sample(
        self, prompt_token_ids: Any, max_tokens: int, eos_token_ids: Any, temperature: float,
        seed: int | None, lora_name: str | None, options: dict[str, Any],
    ) -> Any:
        request = self._request(prompt_token_ids, lora_name)
        eos = self._eos_set(eos_token_ids)
        max_tokens = check_max_tokens(max_tokens)
        temperature = check_temperature(temperature)
        seed = check_seed(seed)
        native = getattr(self.engine, "sample", None)
        if native is not None:
            return await native(request, max_tokens, eos, temperature, seed, options)
        if options:
            raise InvalidRequestError(
                f"{type(self).__name__} takes no sampling options, got {sorted(options)}"
            )
        prompt, lora_name = request.token_ids, request.lora_name
        seed = seed if seed is not None else int.from_bytes(os.urandom(8), "big") >> 1
        generator = torch.Generator().manual_seed(seed)
        context, sampled = list(prompt), []
        for _ in range(max_tokens):
            logprobs = await self.next_token_logprobs(context, lora_name)
            token = await self._draw(logprobs, temperature, generator)
            if token in eos:
                break
            sampled.append(token)
            context.append(token)
        return sampled

    async def batch_sample(
        self,
        prompt_token_ids_list: Iterable[Any],
        max_tokens: int,
        eos_token_ids: Iterable[int],
        temperature: float = 1.0,
        seed: int | None = None,
    ) -> list[list[int]]:
        """Samples one continuation per prompt, concurrently (their steps share batches).

        With a ``seed``, prompt i is sampled with seed ``seed + i``, so the batch is
        reproducible and identical prompts still get independent samples; every such seed
        must be in ``[0, 2**63 - 1]``. Every argument is checked before any prompt is queued.
        """
        return await self._batch_sample(
            prompt_token_ids_list, max_tokens, eos_token_ids, temperature, seed, None, {}
        )

    async def _batch_sample(
        self, prompt_token_ids_list: Iterable[Any], max_tokens: int, eos_token_ids: Any,
        temperature: float, seed: int | None, lora_name: str | None, options: dict[str, Any],
    ) -> list[Any]:
        prompts = [r.token_ids for r in self._requests(prompt_token_ids_list, lora_name)]
        self._eos_set(eos_token_ids)
        check_max_tokens(max_tokens)
        check_temperature(temperature)
        seed = check_seed(seed, len(prompts))
        seeds = [None if seed is None else seed + i for i in range(len(prompts))]
        samples = (
            self._sample(p, max_tokens, eos_token_ids, temperature, s, lora_name, options)
            for p, s in zip(prompts, seeds)
        )
        return list(await asyncio.gather(*samples))

    _draw_thread: EngineThread | None = None  # started by the first draw

    def _draw(
        self, logprobs: torch.Tensor, temperature: float, generator: torch.Generator
    ) -> asyncio.Future:
        """The next token of :meth:`sample`, drawn on a thread of its own: a draw is an O(V)
        pass (about 1 ms at V = 32k; on a GPU, ``.cpu()`` also waits for the row) that on the
        event loop adds up, over concurrent samplers, to blocks of the whole loop."""
        self._check_open()
        if self._draw_thread is None:
            with _DRAW_THREAD_LOCK:  # samplers on several threads' loops start one thread
                if self._draw_thread is None:
                    self._draw_thread = EngineThread(f"genlm-{type(self).__name__}-draws")
        return asyncio.wrap_future(
            self._draw_thread.submit(_draw_token, logprobs, temperature, generator)
        )

    def _eos_set(self, eos_token_ids: Any) -> frozenset[int]:
        return check_eos_token_ids(eos_token_ids, self.vocab_size)


def _draw_token(logprobs: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    logprobs = logprobs.float().cpu()
    if temperature == 0:
        return int(torch.argmax(logprobs))
    probs = torch.softmax(logprobs / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
