"""Rows listed by vLLM (engines with speculative decoding, which take no logits processor),
taken out of each step's output before the output processor turns them into lists
(see :mod:`genlm_backend.llm.vllm.internals`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["install_listed_rows"]

def install_listed_rows(engine: Any, key: str, deliver: Callable[[Any, Any, Any], None]) -> bool:
    """Takes the listed log-probabilities of requests marked in ``extra_args[key]`` out of each
    step's output, before vLLM's output processor turns them into Python lists (one object
    per listed token: ~20 ms for a 32k row on a CPU core).

    ``deliver(mark, token_ids, logprobs)`` gets a marked request's first listed row (NumPy
    arrays; vLLM puts the sampled token first, then the top tokens) on the engine thread;
    the request's own output then carries no log-probabilities. Returns False when the
    output processor lacks the calls this needs.
    """
    processor = getattr(engine, "output_processor", None)
    add = getattr(processor, "add_request", None)
    process = getattr(processor, "process_outputs", None)
    states = getattr(processor, "request_states", None)
    if add is None or process is None or not isinstance(states, dict):
        return False
    marks: dict[str, Any] = {}  # vLLM's request id -> the request's mark

    def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
        params = getattr(request, "sampling_params", None)
        mark = (getattr(params, "extra_args", None) or {}).get(key)
        if mark is not None:
            marks[request.request_id] = mark
        return add(request, *args, **kwargs)

    def process_outputs(outputs: Any, *args: Any, **kwargs: Any) -> Any:
        if marks:
            for output in outputs:
                mark = marks.get(output.request_id)
                lists = None if mark is None else output.new_logprobs
                if lists is not None:
                    output.new_logprobs = None
                    del marks[output.request_id]
                    deliver(mark, lists.logprob_token_ids[0], lists.logprobs[0])
            if len(marks) > 2 * len(states) + 64:  # requests aborted before their first token
                for request_id in [r for r in marks if r not in states]:
                    del marks[request_id]
        return process(outputs, *args, **kwargs)

    processor.add_request, processor.process_outputs = add_request, process_outputs
    return True
