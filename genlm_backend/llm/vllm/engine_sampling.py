"""vLLM's own sampling, the vLLM engine's ``sample``: options mapped to ``SamplingParams``,
concurrent calls batched, each result handed over as soon as its sequence finishes."""

from __future__ import annotations

import asyncio
import numbers
from collections.abc import Callable, Iterable
from typing import Any

from ...batching import Batcher
from ...engine_thread import EngineThread
from ...exceptions import InvalidRequestError, InvalidRequestTypeError
from ..prompts import LogprobsRequest
from .lora_requests import LoRARequests
from .runner import EngineJob, EngineRunner

__all__ = [
    "SAMPLING_OPTIONS",
    "EngineSampler",
    "build_sampling_params",
    "samples_of",
    "strip_at_eos",
    "submit_with_early_delivery",
]

# Options callers may pass to ``sample``/``batch_sample`` besides the contract's arguments.
SAMPLING_OPTIONS = (
    "top_p",
    "top_k",
    "min_p",
    "stop_token_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "n",
    "regex",
    "json_schema",
)


def build_sampling_params(
    *,
    max_tokens: int,
    eos_token_ids: frozenset[int],
    temperature: float,
    seed: int | None,
    options: dict[str, Any],
) -> Any:
    """A ``vllm.SamplingParams`` for one sampling request.

    Generation stops at the first token whose id is in ``eos_token_ids`` or in the
    ``stop_token_ids`` option (the model's own EOS only when it is listed): ``ignore_eos``
    is set so that vLLM stops on ids, never on text.

    Raises:
        InvalidRequestError: an unknown option or a value vLLM refuses.
    """
    from vllm import SamplingParams

    unknown = set(options) - set(SAMPLING_OPTIONS)
    if unknown:
        raise InvalidRequestError(
            f"unknown sampling options {sorted(unknown)}; known: {SAMPLING_OPTIONS}"
        )
    opts = dict(options)
    stop_token_ids = _int_list(opts.pop("stop_token_ids", None) or (), "stop_token_ids")
    stop_ids = set(eos_token_ids) | set(stop_token_ids)
    structured = _structured_outputs(opts.pop("regex", None), opts.pop("json_schema", None))
    n = opts.pop("n", 1)
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise InvalidRequestError(f"n must be a positive int, got {n!r}")
    try:
        return SamplingParams(
            n=int(n),
            max_tokens=max_tokens,
            temperature=temperature,
            seed=seed,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=True,
            detokenize=structured is not None,
            skip_special_tokens=False,
            **({"structured_outputs": structured} if structured is not None else {}),
            **opts,
        )
    except Exception as exc:  # vLLM's own validation errors (not ValueErrors)
        raise InvalidRequestError(f"invalid sampling options: {exc}") from exc


def strip_at_eos(token_ids: Iterable[int], stop_ids: frozenset[int]) -> list[int]:
    """The tokens before the first stop id (the stop id itself is not returned)."""
    out = []
    for tid in token_ids:
        if tid in stop_ids:
            break
        out.append(int(tid))
    return out


def stop_ids_of(params: Any) -> frozenset[int]:
    return frozenset(params.stop_token_ids or ())


def _int_list(values: Any, name: str) -> list[int]:
    if isinstance(values, numbers.Integral):
        values = [values]
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise InvalidRequestTypeError(f"{name} must hold ints, got {v!r}")
        out.append(int(v))
    return out


def _structured_outputs(regex: str | None, json_schema: Any) -> Any:
    if regex is None and json_schema is None:
        return None
    if regex is not None and json_schema is not None:
        raise InvalidRequestError("pass at most one of regex= and json_schema=")
    from vllm.sampling_params import StructuredOutputsParams

    if regex is not None:
        return StructuredOutputsParams(regex=regex)
    # Compact JSON: no free whitespace between tokens, so a token budget is not spent on it.
    return StructuredOutputsParams(json=json_schema, disable_any_whitespace=True)


def samples_of(params: Any) -> Callable[[Any], Any]:
    """``RequestOutput -> result`` for a request sampled with ``params``: the token list cut
    at the first stop id (a list of them, in order, when ``params.n > 1``)."""
    stop_ids = stop_ids_of(params)
    many = params.n > 1

    def convert(output: Any) -> Any:
        ordered = sorted(output.outputs, key=lambda c: c.index)
        samples = [strip_at_eos(c.token_ids, stop_ids) for c in ordered]
        return samples if many else samples[0]

    return convert


async def submit_with_early_delivery(batcher: Any, job: Any) -> Any:
    """Submits ``job`` to ``batcher`` and returns its result as soon as the engine hands it
    over through ``job.deliver``, not when the whole batch ends. Cancelling the caller
    cancels its submission only."""
    loop = asyncio.get_running_loop()
    early = loop.create_future()

    def deliver(result: Any) -> None:
        loop.call_soon_threadsafe(_settle, early, result)

    job.deliver = deliver
    task = loop.create_task(batcher.submit(job))
    task.add_done_callback(lambda t: t.cancelled() or _settle(early, t.exception() or t.result()))
    try:
        result = await early
    except asyncio.CancelledError:
        task.cancel()
        raise
    if isinstance(result, BaseException):
        raise result
    return result


def _settle(future: asyncio.Future, result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class EngineSampler:
    """vLLM's own sampler, the engine's ``sample``: concurrent calls become one engine batch
    (a ``Batcher`` that runs on the engine thread), each result delivered as soon as its
    sequence finishes.

    Args:
        runner: runs the batches' jobs.
        thread: the engine thread.
        lora: the engine's adapters.
        max_batch_size, timeout, flush: of the sampling batcher.
    """

    def __init__(self, runner: EngineRunner, thread: EngineThread, lora: LoRARequests,
                 max_batch_size: int, timeout: float, flush: str):
        self._runner, self._lora = runner, lora
        self.batcher = Batcher(
            runner.run, max_batch_size=max_batch_size, timeout=timeout, flush=flush,
            executor=thread, name="AsyncVirtualLM.sample",
        )

    async def sample(
        self,
        request: LogprobsRequest,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        temperature: float,
        seed: int | None,
        options: dict[str, Any],
    ) -> list[int] | list[list[int]]:
        """Samples a continuation of ``request`` (checked) in vLLM; ``options``: see
        :data:`SAMPLING_OPTIONS`."""
        params = build_sampling_params(
            max_tokens=max_tokens, eos_token_ids=eos_token_ids, temperature=temperature,
            seed=seed, options=options,
        )
        job = EngineJob(request.token_ids, params, samples_of(params),
                        self._lora.request(request.lora_name))
        return await submit_with_early_delivery(self.batcher, job)
