"""How long the event loop is blocked while 64 clients use a backend at once.

A heartbeat task on the loop sleeps 1 ms at a time and records how late it wakes: that
lateness is the longest time any callback (or the thread holding the GIL) kept the loop from
running. Meanwhile ``--clients`` tasks soak the backend with a seeded mix of requests:
``next_token_logprobs`` (prompts from a small shared pool, so concurrent duplicates are
deduplicated and repeats hit the output cache, each sometimes extended by a few tokens),
``batch_next_token_logprobs`` of 4 prompts, and ``sample`` of a few tokens. Each repeat is
one soak of ``--seconds``; a short soak warms up first.

Reported per repeat (and for ``idle``, the same heartbeat with no clients, measured first:
the machine's floor): the heartbeat's max and p99 lateness (ms), the loop thread's own CPU
time in the beat that was latest (``max_cpu_ms``: near ``max_ms`` when the loop itself
computed, near 0 when it waited for the GIL or for a core), the longest garbage collection
(``max_gc_ms``, on any thread: it holds the GIL) and the number of full ones, and requests.

Finding what blocks: ``--cprofile`` prints CPU time by function, of the loop thread alone
before Python 3.12 and of every thread from 3.12 (its cProfile follows all threads);
``--profile`` samples every thread's stack whenever the heartbeat is more than
``--profile-ms`` late (the loop's: what runs on it; the others': who holds the GIL).
``--gc-freeze`` calls ``gc.freeze()`` after loading, as a program may (the start-up heap of
torch and transformers is then no longer walked by every full collection).

Backends: ``mock`` (MockAsyncLM), ``hf`` (AsyncTransformer), ``vllm`` (AsyncVirtualLM), on
``--model tiny`` (the tests' tiny Llama with Mistral's 32k tokenizer) or ``--model default``
(the embedded SmolLM2-135M, see ``genlm_backend/llm/default_model.py``).

    python benchmarks/bench_heartbeat.py --backend mock [--model tiny|default|DIR]
        [--clients 64] [--seconds 5] [--repeats 3] [--seed 0] [--profile] [--cprofile]
        [--gc-freeze] [--tag NAME] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import gc
import io
import pstats
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "llm")]

from benchmarks.common import print_table, write_json

BEAT_S = 0.001


# ---- backends ---------------------------------------------------------------------------


def model_dir(model: str) -> Path:
    if Path(model).is_dir():  # a folder of one (e.g. the tiny model, saved for another machine)
        return Path(model)
    if model == "default":
        from genlm_backend.llm.default_model import default_model_dir

        return default_model_dir()
    from hf_fixtures import tiny_llama_dir

    return tiny_llama_dir()


def make_backend(backend: str, model: str, cache_size: int) -> Any:
    if backend == "mock":
        from transformers import AutoTokenizer

        from genlm_backend.llm.mock import MockAsyncLM

        return MockAsyncLM(AutoTokenizer.from_pretrained(model_dir(model)), cache_size=cache_size)
    if backend == "hf":
        from genlm_backend.llm.hf import AsyncTransformer

        return AsyncTransformer.from_name(str(model_dir(model)), cache_size=cache_size)
    from genlm_backend.llm.vllm import AsyncVirtualLM

    if model == "tiny":  # the vLLM tests' tiny model
        from vllm_fixtures import build_tiny_llama

        folder = build_tiny_llama(Path(tempfile.mkdtemp(prefix="genlm-heartbeat-")) / "base")
    else:
        folder = model_dir(model)
    opts = {"max_model_len": 512, "enforce_eager": True, "seed": 0}
    return AsyncVirtualLM.from_name(str(folder), engine_opts=opts, cache_size=cache_size)


# ---- the soak ---------------------------------------------------------------------------


class Heartbeat:
    """Lateness of 1 ms sleeps on the loop, with the loop thread's CPU time in each beat."""

    def __init__(self) -> None:
        self.late_s: list[float] = []
        self.cpu_s: list[float] = []
        self.last_beat = time.perf_counter()
        self.running = True

    async def run(self) -> None:
        while self.running:
            start, cpu = time.perf_counter(), time.thread_time()
            await asyncio.sleep(BEAT_S)
            self.last_beat = now = time.perf_counter()
            self.late_s.append(max(0.0, now - start - BEAT_S))
            self.cpu_s.append(time.thread_time() - cpu)


class GCPauses:
    """Durations of the cyclic garbage collector's runs while installed."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self.num_full = 0  # collections of the oldest generation
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses_s.append(time.perf_counter() - self._start)
            self.num_full += info["generation"] == 2


class StackSampler(threading.Thread):
    """While the heartbeat is more than ``late_s`` late, samples the stack of every other
    thread: the loop's (what runs on it) and the rest (who holds the GIL meanwhile)."""

    def __init__(self, heart: Heartbeat, loop_thread: int, late_s: float):
        super().__init__(daemon=True, name="heartbeat-sampler")
        self.heart, self.loop_thread, self.late_s = heart, loop_thread, late_s
        self.counts: collections.Counter[str] = collections.Counter()
        self.stopped = threading.Event()

    def run(self) -> None:
        names = {}
        while not self.stopped.wait(0.002):
            if time.perf_counter() - self.heart.last_beat <= self.late_s:
                continue
            for ident, frame in sys._current_frames().items():
                if ident == self.ident:
                    continue
                if ident not in names:
                    names[ident] = "loop" if ident == self.loop_thread else _thread_name(ident)
                self.counts[f"[{names[ident]}] {_describe(traceback.extract_stack(frame))}"] += 1


def _thread_name(ident: int) -> str:
    return next((t.name for t in threading.enumerate() if t.ident == ident), str(ident))


def _describe(stack: traceback.StackSummary) -> str:
    """The innermost frames of the package, or of anything where it has none, innermost last."""
    ours = [
        f for f in stack if "genlm_backend" in f.filename and "bench_heartbeat" not in f.filename
    ]
    frames = [*ours[-2:], *(f for f in stack[-2:] if f not in ours[-2:])]
    return " > ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames)


async def soak(lm: Any, *, clients: int, seconds: float, seed: int, sampler_ms: float | None):
    rng = random.Random(seed)
    vocab = lm.vocab_size
    pool = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 64))] for _ in range(32)]
    heart = Heartbeat()
    sampler = None
    if sampler_ms is not None:
        sampler = StackSampler(heart, threading.get_ident(), sampler_ms / 1000)
        sampler.start()
    counts = collections.Counter()
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        own = random.Random(seed * 1000 + i)
        while time.perf_counter() < deadline:
            prompt = list(own.choice(pool))
            if own.random() < 0.5:
                prompt += [own.randrange(3, vocab) for _ in range(own.randrange(0, 3))]
            op = own.random()
            if op < 0.5:
                await lm.next_token_logprobs(prompt)
                counts["next_token_logprobs"] += 1
            elif op < 0.75:
                await lm.batch_next_token_logprobs([prompt, *own.sample(pool, 3)])
                counts["batch_next_token_logprobs"] += 1
            else:
                await lm.sample(prompt, max_tokens=4, eos_token_ids=[], seed=own.randrange(1 << 30))
                counts["sample"] += 1

    gc_pauses = GCPauses()
    gc.callbacks.append(gc_pauses)
    beat = asyncio.ensure_future(heart.run())
    try:
        await asyncio.sleep(0.01)
        await asyncio.gather(
            *(client(i) for i in range(clients)), asyncio.sleep(0 if clients else seconds)
        )
    finally:
        heart.running = False
        await beat
        gc.callbacks.remove(gc_pauses)
    heart.gc_pauses_s, heart.num_full_gc = gc_pauses.pauses_s, gc_pauses.num_full
    if sampler is not None:
        sampler.stopped.set()
        sampler.join()
    return heart, counts, sampler


def summarise_beats(heart: Heartbeat) -> dict[str, float]:
    late = heart.late_s
    worst = max(range(len(late)), key=late.__getitem__)
    return {
        "max_ms": 1000 * late[worst],
        "p99_ms": 1000 * statistics.quantiles(late, n=100)[98],
        "p50_ms": 1000 * statistics.median(late),
        "max_cpu_ms": 1000 * heart.cpu_s[worst],
        "max_gc_ms": 1000 * max(heart.gc_pauses_s, default=0.0),
        "full_gcs": heart.num_full_gc,
        "beats": len(late),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", choices=["mock", "hf", "vllm"], default="mock")
    parser.add_argument("--model", default="tiny", help="tiny, default, or a model folder")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile", action="store_true", help="sample stacks while the loop is late"
    )
    parser.add_argument("--profile-ms", type=float, default=20.0)
    parser.add_argument(
        "--cprofile", action="store_true", help="profile CPU time (see above: which threads)"
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() the heap after loading"
    )
    parser.add_argument("--tag", default="", help="appended to the result file's name")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    random.seed(args.seed)
    import torch

    torch.manual_seed(args.seed)
    lm = make_backend(args.backend, args.model, args.cache_size)
    if (
        args.gc_freeze
    ):  # the program's choice (vLLM's engine core does it for its own start-up heap)
        gc.collect()
        gc.freeze()
    profile_ms = args.profile_ms if args.profile else None
    profiler = cProfile.Profile() if args.cprofile else None
    rows, stacks = [], collections.Counter()
    try:
        asyncio.run(
            soak(
                lm,
                clients=args.clients,
                seconds=min(1.0, args.seconds),
                seed=args.seed,
                sampler_ms=None,
            )
        )
        idle, _, _ = asyncio.run(
            soak(lm, clients=0, seconds=min(2.0, args.seconds), seed=args.seed, sampler_ms=None)
        )
        rows.append(
            {"repeat": "idle", **summarise_beats(idle), "requests": 0}
        )  # the floor: no clients
        for repeat in range(args.repeats):
            lm.clear_cache()
            if profiler is not None:
                profiler.enable()  # the loop's thread (every thread from Python 3.12)
            heart, counts, sampler = asyncio.run(
                soak(
                    lm,
                    clients=args.clients,
                    seconds=args.seconds,
                    seed=args.seed + 1 + repeat,
                    sampler_ms=profile_ms,
                )
            )
            if profiler is not None:
                profiler.disable()
            rows.append(
                {
                    "repeat": repeat,
                    **summarise_beats(heart),
                    "requests": sum(counts.values()),
                    **counts,
                }
            )
            if sampler is not None:
                stacks.update(sampler.counts)
            print(
                f"repeat {repeat}: max {rows[-1]['max_ms']:.1f} ms, p99 {rows[-1]['p99_ms']:.2f} ms",
                file=sys.stderr,
            )
        stats = lm.stats()
    finally:
        lm.cleanup()
    soaks = rows[1:]
    summary = {
        "repeat": "all",
        "max_ms": max(r["max_ms"] for r in soaks),
        "p99_ms": statistics.median(r["p99_ms"] for r in soaks),
        "p50_ms": statistics.median(r["p50_ms"] for r in soaks),
        "max_vs_idle": max(r["max_ms"] for r in soaks) / max(rows[0]["max_ms"], 1e-3),
    }
    columns = [
        "repeat",
        "max_ms",
        "p99_ms",
        "p50_ms",
        "max_cpu_ms",
        "max_gc_ms",
        "full_gcs",
        "beats",
        "requests",
        "next_token_logprobs",
        "batch_next_token_logprobs",
        "sample",
        "max_vs_idle",
    ]
    print(
        f"backend={args.backend} model={args.model} clients={args.clients} seconds={args.seconds}"
        f" gc_freeze={args.gc_freeze}"
    )
    print_table([*rows, summary], columns)
    if stacks:
        print(
            f"\nthreads while the heartbeat was > {args.profile_ms:g} ms late (samples, every 2 ms):"
        )
        for stack, n in stacks.most_common(16):
            print(f"{n:6d}  {stack}")
    top = []
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
        top = out.getvalue().strip().splitlines()
        which = "every thread's" if sys.version_info >= (3, 12) else "the loop thread's"
        print(f"\n{which} CPU time, by function (own time):\n" + "\n".join(top[-22:]))
    name = f"heartbeat_{args.backend}" + (f"_{args.tag}" if args.tag else "")
    path = write_json(
        name,
        {
            "backend": args.backend,
            "model": args.model,
            "clients": args.clients,
            "seconds": args.seconds,
            "cache_size": args.cache_size,
            "seed": args.seed,
            "gc_freeze": args.gc_freeze,
            "rows": rows,
            "summary": summary,
            "backend_stats": stats,
            "late_stacks": dict(stacks.most_common(30)),
            "loop_cprofile": top[-22:],
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
