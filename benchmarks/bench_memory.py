"""Memory: what 1000 cached log-probability rows hold, against the floor of V*4 bytes a row.

For each size n (distinct contexts: one shared prompt plus one distinct last token each), a
fresh output cache of n rows (``lm.cache = OutputCache(n)``) is filled by evaluating the n
contexts through the awaited, cached path (``batch_next_token_logprobs``, 64 contexts per
call). Measured, per 1000 rows:

* ``tensor``: the bytes of the storages of the cached tensors (distinct storages counted
  once): what the cache itself pins;
* ``rss``: the growth of the process's resident memory over the fill (CPU), which adds the
  cache's keys and bookkeeping and whatever the allocator keeps;
* ``cuda_held`` / ``cuda_peak``: on CUDA, ``torch.cuda.memory_allocated`` after the fill and
  ``max_memory_allocated`` during it, less ``memory_allocated`` before.

The floor is V*4 bytes a row (one float32 per vocabulary entry). Before each measured fill,
a few batches run uncached (``batch_next_token_logprobs_sync``), so the allocator's transient
buffers are grown already, and the C heap is trimmed before both readings of resident
memory. The Hugging Face backend's key/value trie is bounded to 0 bytes for these fills (so
it does not count in ``rss``); one more fill on a fresh backend with ``cache_size=0`` and the
default bound measures the trie: ``kv_cache_bytes`` per 1000 contexts against its floor,
(prompt length + n) tokens x 2 x layers x kv heads x head dim x element size, the states of
the distinct tokens. Each fill is repeated; medians with min and max.

CPU (tiny random Llama of ``bench_w1_hf.py``, V=32000; ~1 minute)::

    OMP_NUM_THREADS=1 python benchmarks/bench_memory.py [--backends hf vllm]

GPU (HF: the 1.2B Llama of ``bench_w1_hf.py --device cuda``; vLLM: the 1.2B Llama of
``models.py``)::

    python benchmarks/bench_memory.py --gpu --backends hf vllm --tokenizer-dir .gpu_assets/tekken
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.common import print_table, write_json

CHUNK = 64  # contexts per awaited batch call


# ---- measuring ----------------------------------------------------------------------------


def rss_bytes() -> int | None:
    """The resident memory of this process now (not its peak), or None where unknown."""
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return None


def trim_heap() -> None:
    """Hands the C heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere a no-op),
    so that resident memory counts live allocations, not what the allocator kept."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def tensor_bytes(values: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``values``."""
    seen, total = set(), 0
    for value in values:
        if not isinstance(value, torch.Tensor):
            continue
        storage = value.untyped_storage()
        key = (storage.data_ptr(), value.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def cached_tensors(lm: Any) -> list[torch.Tensor]:
    # OutputCache keeps (tensor, original device) pairs in an LRU mapping.
    return [value for value, _device in lm.cache._entries.values()]


def make_contexts(
    num_contexts: int, prompt_len: int, vocab_size: int, seed: int
) -> list[list[int]]:
    """One shared random prompt plus a distinct last token per context."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1, vocab_size) for _ in range(prompt_len)]
    last = rng.sample(range(1, vocab_size), num_contexts)
    return [prompt + [t] for t in last]


def fill(lm: Any, contexts: list[list[int]]) -> None:
    async def run() -> None:
        for i in range(0, len(contexts), CHUNK):
            await lm.batch_next_token_logprobs(contexts[i : i + CHUNK])

    asyncio.run(run())


def _collect(device: str) -> None:
    gc.collect()
    trim_heap()
    if device == "cuda":
        torch.cuda.synchronize()


def measure_fill(
    lm: Any, contexts: list[list[int]], warm: list[list[int]], device: str
) -> dict[str, Any]:
    """One fill of a fresh output cache of ``len(contexts)`` rows; returns bytes held and time."""
    from genlm_backend.cache import OutputCache

    lm.cache = None
    for i in range(0, len(warm), CHUNK):  # uncached: grows the allocator's transient buffers
        lm.batch_next_token_logprobs_sync(warm[i : i + CHUNK])
    _collect(device)
    lm.cache = OutputCache(len(contexts))
    rss0 = rss_bytes()
    if device == "cuda":
        cuda0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fill(lm, contexts)
    seconds = time.perf_counter() - start
    _collect(device)
    out: dict[str, Any] = {"fill_s": seconds, "num_cached": len(lm.cache)}
    out["tensor_bytes"] = tensor_bytes(cached_tensors(lm))
    rss1 = rss_bytes()
    out["rss_bytes"] = None if rss0 is None or rss1 is None else rss1 - rss0
    if device == "cuda":
        out["cuda_held_bytes"] = torch.cuda.memory_allocated() - cuda0
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated() - cuda0
    lm.cache = None
    _collect(device)
    return out


def measure_kv(model: Any, contexts: list[list[int]]) -> dict[str, Any]:
    """The HF backend's key/value trie after evaluating ``contexts`` (no output cache)."""
    from benchmarks.bench_w1_hf import id_tokenizer
    from genlm_backend.llm.hf import AsyncTransformer

    with AsyncTransformer(model, id_tokenizer(model.config.vocab_size), batch_size=CHUNK) as lm:
        before = lm.stats()["kv_cache_bytes"]
        fill(lm, contexts)
        stats = lm.stats()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element = next(model.parameters()).element_size()
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    num_tokens = len(contexts[0]) - 1 + len(contexts)  # the shared prompt once, then one token each
    return {
        "kv_cache_bytes": stats["kv_cache_bytes"] - before,
        "kv_floor_bytes": per_token * num_tokens,
        "kv_bytes_per_token_floor": per_token,
        "kv_blocks": stats["kv_cache_blocks"],
    }


# ---- backends -----------------------------------------------------------------------------


def hf_backend(args: argparse.Namespace) -> tuple[Any, Any]:
    """(backend, model): the HF backend on the W1 model of ``bench_w1_hf``, its key/value trie
    bounded to 0 bytes (so that it holds nothing between batches)."""
    from benchmarks import bench_w1_hf
    from genlm_backend.llm.hf import AsyncTransformer

    hf_args = bench_w1_hf.parse_args(["--device", args.device, "--seed", str(args.seed)])
    model = bench_w1_hf.build_model(hf_args)
    tokenizer = bench_w1_hf.build_tokenizer(hf_args, model)
    return AsyncTransformer(model, tokenizer, batch_size=CHUNK, max_kv_cache_bytes=0), model


def vllm_backend(args: argparse.Namespace) -> tuple[Any, Any]:
    """(backend, None): the vLLM backend on the model and engine options of W1 and W2."""
    from benchmarks import bench_w2_sampling
    from genlm_backend.llm.vllm import AsyncVirtualLM

    lm = AsyncVirtualLM.from_name(
        str(bench_w2_sampling.model_dir_for(args)),
        engine_opts=bench_w2_sampling.engine_opts_for(args),
        batch_size=CHUNK,
    )
    return lm, None


def spread(values: list[float], scale: float) -> tuple[float, float, float]:
    """(median, min, max) of ``values``, times ``scale``."""
    return statistics.median(values) * scale, min(values) * scale, max(values) * scale


# ---- main ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for backend in args.backends:
        lm, model = (hf_backend if backend == "hf" else vllm_backend)(args)
        vocab = lm.vocab_size
        floor_per_1000 = 4 * vocab * 1000
        try:
            for n in args.rows:
                contexts = make_contexts(n, args.prompt_len, vocab, args.seed)
                warm = make_contexts(min(n, 4 * CHUNK), args.prompt_len, vocab, args.seed + 1)
                fills = [measure_fill(lm, contexts, warm, args.device) for _ in range(args.repeats)]
                if any(f["num_cached"] != n for f in fills):
                    raise RuntimeError(
                        f"{backend}: the cache holds {fills[0]['num_cached']} rows, not {n}"
                    )
                row: dict[str, Any] = {
                    "backend": backend,
                    "rows": n,
                    "V": vocab,
                    "floor_bytes_per_1000": floor_per_1000,
                    "fills": fills,
                    "fill_s": statistics.median(f["fill_s"] for f in fills),
                }
                for name in ("tensor", "rss", "cuda_held", "cuda_peak"):
                    values = [
                        f[f"{name}_bytes"] for f in fills if f.get(f"{name}_bytes") is not None
                    ]
                    if values:
                        median, low, high = spread(values, 1000 / n)
                        row.update(
                            {
                                f"{name}_per_1000": median,
                                f"{name}_per_1000_min": low,
                                f"{name}_per_1000_max": high,
                                f"{name}_ratio": median / floor_per_1000,
                            }
                        )
                if model is not None:
                    kv = measure_kv(model, contexts)
                    row.update(kv)
                    row["kv_per_1000"] = kv["kv_cache_bytes"] * 1000 / n
                    row["kv_floor_per_1000"] = kv["kv_floor_bytes"] * 1000 / n
                    row["kv_ratio"] = kv["kv_cache_bytes"] / kv["kv_floor_bytes"]
                rows.append(row)
                print(
                    f"{backend} n={n}: "
                    + ", ".join(
                        f"{m} {row[f'{m}_per_1000'] / 2**20:.1f} MiB/1000 "
                        f"({row[f'{m}_ratio']:.3f}x)"
                        for m in ("tensor", "rss", "cuda_held", "cuda_peak", "kv")
                        if f"{m}_per_1000" in row
                    ),
                    f"floor {floor_per_1000 / 2**20:.1f} MiB/1000",
                    flush=True,
                )
        finally:
            lm.cleanup()
            del lm, model
            _collect(args.device)
            if args.device == "cuda":
                torch.cuda.empty_cache()  # leave the next backend the whole device
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return {
        "description": "bytes held per 1000 cached log-probability rows, against V*4 bytes a row",
        "config": config,
        "rows": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="on CUDA, the models of the GPU W1 runs")
    parser.add_argument("--backends", nargs="+", choices=("hf", "vllm"), default=["hf"])
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[1000, 4000], help="cache sizes n to fill"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-dir", type=Path, default=None, help="vLLM backend: HF tokenizer folder"
    )
    parser.add_argument(
        "--model-dir", default=None, help="vLLM backend: where its random model is built"
    )
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    args.device = "cuda" if args.gpu else "cpu"
    if args.gpu and "vllm" in args.backends and args.tokenizer_dir is None:
        parser.error(
            "--gpu with the vllm backend needs --tokenizer-dir "
            "(run benchmarks/prepare_gpu_assets.py)"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    result = run(args)
    columns = [
        "backend",
        "rows",
        "V",
        "floor_bytes_per_1000",
        "tensor_per_1000",
        "tensor_ratio",
        "rss_per_1000",
        "rss_ratio",
        "cuda_held_per_1000",
        "cuda_peak_per_1000",
        "cuda_peak_ratio",
        "kv_per_1000",
        "kv_floor_per_1000",
        "kv_ratio",
        "fill_s",
    ]
    print_table(result["rows"], [c for c in columns if any(c in r for r in result["rows"])])
    name = "memory_gpu" if args.gpu else "memory_cpu"
    print("wrote", write_json(name, result, args.out_dir))
    return result


if __name__ == "__main__":
    main()
