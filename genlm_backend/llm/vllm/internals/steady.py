"""Steady held steps: a lockstep step of held sessions without vLLM's general scheduling,
its per-request update and its outputs (checked against 0.26.0 and 0.32.0; see
:mod:`genlm_backend.llm.vllm.internals`).

In a lockstep run every step after the first is the same: each running request is a held
session that was scheduled the step before and has taken one forced token since. vLLM's
``schedule()`` still walks every request (budgets, encoder inputs, a slot allocation each),
``update_from_output`` builds an output for each, and the output processor reads them all,
although a held session's result is its row (taken inside the step) and nobody reads
those outputs. For such a step :func:`install_steady_steps` builds the scheduler output
itself: the last plain output with each request's computed count advanced, KV slots
allocated only for the requests that start or fill a block, and the scheduler's own
``_update_after_schedule``. When every request takes its one token without stopping, it
appends the tokens and returns no outputs. Anything else (a new request, a resumed or
parked session, a request that would stop, a plain request running beside the sessions)
goes through vLLM's own code for that step.

What is relied on (both versions): ``Scheduler.running``, ``requests``, ``waiting`` and the
queues of :func:`.sessions.install_parked_bypass` with ``num_waiting_for_streaming_input``,
``finished_req_ids``, ``reset_preempted_req_ids``, ``current_step``, ``max_model_len``,
``max_num_scheduled_tokens``, ``kv_cache_manager`` (``new_step_starts``, ``allocate_slots(
request, num_new_tokens, num_lookahead_tokens=...)`` returning blocks with
``get_block_ids(allow_none=True)``, ``block_pool.get_num_free_blocks()``),
``kv_cache_config.kv_cache_groups`` with one full-attention spec; ``Request.resumable`` and
its parameters' ``output_kind`` (a held session's); ``SchedulerOutput`` a dataclass and
``CachedRequestData`` with the fields built below; ``Request.num_tokens``, ``num_computed_tokens``,
``num_output_placeholders``, ``spec_token_ids``, ``num_in_flight_tokens``, ``max_tokens``,
``num_output_tokens``, ``append_output_token_ids``; and vLLM's stop check (``check_stop``:
the end-of-sequence id of the request's parameters, ``stop_token_ids``, ``max_tokens``,
``max_model_len``, ``min_tokens``, ``repetition_detection``).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from vllm.sampling_params import RequestOutputKind

from .engine_core import _scheduler
from .installed import installed_on

__all__ = ["install_steady_steps"]

# Scheduler-output fields a steady step sets itself; every other field of the last plain
# output must be empty (so a field a later vLLM adds turns the steady path off, not wrong).
_SET_HERE = frozenset({
    "scheduled_cached_reqs", "num_scheduled_tokens", "total_num_scheduled_tokens",
    "num_common_prefix_blocks", "finished_req_ids", "free_encoder_mm_hashes",
})
# The scheduler's waiting queues (0.26 and 0.32), and what its update reports beside outputs.
_QUEUES = ("waiting", "skipped_waiting", "kv_holding_waiting")
_REPORTS = ("finished_req_ids_dict", "grammar_compile_error_reqs", "encoder_cache_mismatch_reqs")


def install_steady_steps(engine: Any) -> Any:
    """Wraps the in-process scheduler's ``schedule`` and ``update_from_output`` so that
    steady steps of held sessions skip vLLM's general code (see the module). Returns the
    :class:`SteadySteps` installed (with its counts), or None where the engine is not one
    this was checked on: no scheduler in this process, async scheduling, pipeline
    parallelism, speculative decoding, a KV connector, statistics logging, deferred block
    frees, a KV cache that is not one full-attention group, or rows read from each step's
    output (:mod:`.remote` where the rows come after sampling)."""
    scheduler = _scheduler(engine)
    if scheduler is None:
        return None
    installed = installed_on(scheduler).get("steady")
    if installed is not None and installed() is not None:
        return installed()
    block_size = _full_attention_block_size(scheduler)
    if block_size is None or not _plain_scheduler(scheduler):
        return None
    if "before_update" in installed_on(scheduler):
        return None  # hooks read each step's output, which a steady update does not make
    steady = SteadySteps(scheduler, block_size)
    scheduler.schedule = steady.schedule
    scheduler.update_from_output = steady.update_from_output
    installed_on(scheduler)["steady"] = weakref.ref(steady)  # (steady refers to scheduler)
    return steady


def _full_attention_block_size(scheduler: Any) -> int | None:
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None)
    if not groups or len(groups) != 1:
        return None
    if type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec":
        return None
    block_size = groups[0].kv_cache_spec.block_size
    if getattr(scheduler, "hash_block_size", block_size) != block_size:
        return None
    return block_size


def _plain_scheduler(scheduler: Any) -> bool:
    config = scheduler.scheduler_config
    parts = ("running", "requests", "waiting", "finished_req_ids", "reset_preempted_req_ids",
             "current_step", "max_model_len", "max_num_scheduled_tokens", "kv_cache_manager",
             "num_waiting_for_streaming_input", "_update_after_schedule")
    return (
        all(hasattr(scheduler, name) for name in parts)
        and type(scheduler).__name__ == "Scheduler"
        and not getattr(config, "async_scheduling", False)
        and not getattr(scheduler, "use_pp", False)
        and not getattr(scheduler, "num_lookahead_tokens", 0)
        and not getattr(scheduler, "num_spec_tokens", 0)
        and not getattr(scheduler, "log_stats", True)
        and not getattr(scheduler, "defer_block_free", False)
        and not getattr(scheduler, "enable_return_routed_experts", False)
        and all(getattr(scheduler, name, None) is None
                for name in ("connector", "ec_connector", "aux_output_connector"))
        and not getattr(scheduler.kv_cache_manager, "enable_kv_cache_events", False)
        and not getattr(getattr(scheduler, "perf_metrics", None), "is_enabled", lambda: False)()
    )


class SteadySteps:
    """The wrapped ``schedule`` and ``update_from_output`` of one scheduler, and how many
    steps took the steady path (``num_steady``)."""

    def __init__(self, scheduler: Any, block_size: int):
        self.scheduler = scheduler
        self.block_size = block_size
        self._general_schedule = scheduler.schedule
        self._general_update = scheduler.update_from_output
        self.num_steady = 0
        self._template: Any = None  # a plain output: held sessions alone, one token each
        self._last: Any = None  # the last output returned
        self._sessions: list[Any] | None = None  # the requests of _last, if it is plain

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = self._steady_output() if self._template is not None else None
        if output is None:
            output = self._general_schedule(*args, **kwargs)
            self._sessions = self._plain_sessions(output)
            if self._sessions is not None:
                self._template = output
        else:
            self.num_steady += 1
        self._last = output
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if scheduler_output is not self._last or self._sessions is None or not self._takes_tokens(
            model_runner_output
        ):
            return self._general_update(scheduler_output, model_runner_output)
        return {}

    def _plain_sessions(self, output: Any) -> list[Any] | None:
        """The requests of ``output`` where it is a decode step of held sessions alone, one
        token each, with nothing else to do; else None."""
        cached = output.scheduled_cached_reqs  # (the other fields: empty, checked below)
        if cached.resumed_req_ids or cached.new_token_ids or cached.all_token_ids:
            return None
        for field in dataclasses.fields(output):
            if field.name not in _SET_HERE and getattr(output, field.name):
                return None
        ids = cached.req_ids
        if not (output.total_num_scheduled_tokens == len(output.num_scheduled_tokens) == len(ids)):
            return None
        requests = self.scheduler.requests
        sessions = [requests[i] for i in ids]
        return sessions if all(map(_is_session, sessions)) else None

    def _steady_output(self) -> Any:
        """This step's output where it is steady: every running request is a held session
        that the last step ran and that has one token to take (see the module); else None,
        having changed nothing."""
        scheduler = self.scheduler
        running = scheduler.running
        queued = sum(len(getattr(scheduler, name, ())) for name in _QUEUES)
        if (not running or queued != scheduler.num_waiting_for_streaming_input  # parked only
                or scheduler.reset_preempted_req_ids
                or len(running) > scheduler.max_num_scheduled_tokens):
            return None
        last_ran, block_size = self._last.num_scheduled_tokens, self.block_size
        limit = scheduler.max_model_len - 1
        edges = []  # requests whose token starts a block (a new one) or fills it (cached)
        num_new_blocks = 0
        for i, request in enumerate(running):
            computed = request.num_computed_tokens
            if (request.request_id not in last_ran or request.num_tokens - computed != 1
                    or computed >= limit or request.num_output_placeholders
                    or request.spec_token_ids or not _is_session(request)):
                return None
            starts = computed % block_size == 0
            if starts or (computed + 1) % block_size == 0:
                edges.append(i)
                num_new_blocks += starts
        manager = scheduler.kv_cache_manager
        if num_new_blocks > manager.block_pool.get_num_free_blocks():
            return None  # vLLM's step preempts
        scheduler.current_step += 1
        manager.new_step_starts()
        new_block_ids: list[Any] = [None] * len(running)
        for i in edges:
            blocks = manager.allocate_slots(running[i], 1, num_lookahead_tokens=0)
            if blocks is None:  # the free blocks were counted above
                raise RuntimeError("vLLM refused a KV block the steady step counted as free")
            new_block_ids[i] = blocks.get_block_ids(allow_none=True)
        self._sessions = sessions = list(running)
        return self._output(sessions, new_block_ids)

    def _output(self, sessions: list[Any], new_block_ids: list[Any]) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData

        scheduler, manager = self.scheduler, self.scheduler.kv_cache_manager
        common = self._template.num_common_prefix_blocks
        if common and hasattr(manager, "get_num_common_prefix_blocks"):
            common = manager.get_num_common_prefix_blocks(sessions[0].request_id)
        ids = [r.request_id for r in sessions]
        cached = CachedRequestData(
            req_ids=ids, resumed_req_ids=set(), new_token_ids=[], all_token_ids={},
            new_block_ids=new_block_ids,
            num_computed_tokens=[r.num_computed_tokens for r in sessions],
            num_output_tokens=[r.num_output_tokens for r in sessions],
        )
        output = dataclasses.replace(
            self._template, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict.fromkeys(ids, 1), total_num_scheduled_tokens=len(ids),
            num_common_prefix_blocks=common,
            finished_req_ids=scheduler.finished_req_ids,
            free_encoder_mm_hashes=scheduler.encoder_cache_manager.get_freed_mm_hashes(),
        )
        scheduler._update_after_schedule(output)
        return output

    def _takes_tokens(self, model_runner_output: Any) -> bool:
        """Appends each session's one sampled token where none of them stops (vLLM's
        ``check_stop``) and the scheduler has nothing else to report; else changes nothing."""
        scheduler = self.scheduler
        if any(getattr(scheduler, name, None) for name in _REPORTS):
            return False
        sampled, index = model_runner_output.sampled_token_ids, model_runner_output.req_id_to_index
        length_limit = scheduler.max_model_len - 1
        tokens = []
        for request in self._sessions:
            new = sampled[index[request.request_id]]
            params = request.sampling_params
            if (len(new) != 1 or request.is_finished() or new[0] == params.eos_token_id
                    or params.stop_token_ids or params.min_tokens
                    or params.repetition_detection is not None
                    or request.num_output_tokens + 1 >= request.max_tokens
                    or request.num_tokens >= length_limit):
                return False
            tokens.append(new[0])
        for request, token in zip(self._sessions, tokens):
            request.num_in_flight_tokens -= 1
            request.append_output_token_ids(token)
        return True


def _is_session(request: Any) -> bool:
    """A held session's request: resumable, its outputs only at a chunk's end."""
    final_only = RequestOutputKind.FINAL_ONLY
    return (getattr(request, "resumable", False)
            and request.sampling_params.output_kind is final_only)
