"""How long the event loop is blocked while 64 clients use a backend at once.

A heartbeat task on the loop sleeps 1 ms at a time and records how late it wakes: that
lateness is the longest time any callback (or the thread holding the GIL) kept the loop from
running. Meanwhile ``--clients`` tasks soak the backend with a seeded mix of requests:
``next_token_logprobs`` (prompts from a small shared pool, so concurrent duplicates are
deduplicated and repeats hit the output cache, each sometimes extended by a few tokens),
``batch_next_token_logprobs`` of 4 prompts, and ``sample`` of a few tokens. ``--cancel``
of the calls (10% by default) are cancelled by their client a few milliseconds after they
were made (before or after their batch ran), and ``--malformed`` of them (1%) send a bad
prompt (empty, an id outside the vocabulary, a negative id, a float, a string), which must
be refused with ``InvalidRequestError`` / ``InvalidRequestTypeError``. Each repeat is one
soak of ``--seconds``; a short soak warms up first.

Reported per repeat (and for ``idle``, the same heartbeat with no clients, measured first:
the machine's floor): the heartbeat's max and p99 lateness (ms); for the beat that was
latest, the loop thread's own CPU time (``max_cpu_ms``: near ``max_ms`` when the loop itself
computed) and its wait for a core (``max_runq_ms``, Linux: the machine's other load);
``own_max_ms``/``own_p99_ms``, each beat's lateness less that wait (the loop's own work and
its waits for the GIL); ``unwaited_max_ms``, the lateness less the longest wait for a core of
any thread of the process in that beat (a lower bound of what the process itself caused: a
GIL holder that waits for a core keeps the loop waiting); the most CPU the loop thread used in
one beat (``loop_cpu_*``); the longest garbage collection (``max_gc_ms`` wall,
``max_gc_cpu_ms`` CPU, on any thread: it holds the GIL), the number of full ones, and the CPU
time of one full collection run right after the soak (``full_gc_now_cpu_ms``: what the next
one would block); and requests (of which ``cancelled`` and ``malformed``). Also printed: the
loop's callbacks that used the most CPU, whatever the load (a task's step is named by where its
coroutine resumed).

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
        [--clients 64] [--seconds 5] [--repeats 3] [--seed 0] [--cancel 0.1]
        [--malformed 0.01] [--profile] [--cprofile] [--gc-freeze] [--tag NAME] [--out DIR]
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "llm")]

from benchmarks.common import print_table, write_json
from benchmarks.loop_probes import CallbackTimer, GCPauses, Heartbeat, StackSampler

OPERATIONS = ("next_token_logprobs", "batch_next_token_logprobs", "sample")


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


def malformed_prompt(rng: random.Random, vocab: int) -> Any:
    """A prompt every backend must refuse before queueing it."""
    return rng.choice([[], [3, vocab], [3, -1], [3, 1.5], "a string"])


async def soak(
    lm: Any,
    *,
    clients: int,
    seconds: float,
    seed: int,
    sampler_ms: float | None,
    cancel: float = 0.0,
    malformed: float = 0.0,
):
    from genlm_backend.exceptions import InvalidRequestError, InvalidRequestTypeError

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
            is_malformed = own.random() < malformed
            if is_malformed:
                prompt = malformed_prompt(own, vocab)
            op = own.random()
            if op < 0.5:
                name, call = "next_token_logprobs", lm.next_token_logprobs(prompt)
            elif op < 0.75:
                name = "batch_next_token_logprobs"
                call = lm.batch_next_token_logprobs([*own.sample(pool, 3), prompt])
            else:
                name = "sample"
                draw_seed = own.randrange(1 << 30)
                call = lm.sample(prompt, max_tokens=4, eos_token_ids=[], seed=draw_seed)
            counts[name] += 1
            counts["malformed"] += is_malformed
            task = None
            if own.random() < cancel:  # the client gives up a few milliseconds later
                task = call = asyncio.ensure_future(call)
                await asyncio.sleep(own.choice([0, 0.001, 0.003]))
                task.cancel()
                counts["cancelled"] += 1
            try:
                await call
            except asyncio.CancelledError:
                if task is None or not task.cancelled():
                    raise  # this client itself was cancelled
            except (InvalidRequestError, InvalidRequestTypeError):
                if not is_malformed:
                    raise
            else:
                if is_malformed:
                    raise AssertionError(f"{name} accepted the malformed prompt {prompt!r}")

    gc_pauses = GCPauses()
    gc.callbacks.append(gc_pauses)
    beat = asyncio.ensure_future(heart.run())
    try:
        with CallbackTimer() as callbacks:
            await asyncio.sleep(0.01)
            await asyncio.gather(
                *(client(i) for i in range(clients)), asyncio.sleep(0 if clients else seconds)
            )
    finally:
        heart.running = False
        await beat
        gc.callbacks.remove(gc_pauses)
    heart.gc_pauses_s, heart.num_full_gc = gc_pauses.pauses_s, gc_pauses.num_full
    heart.gc_cpu_s = gc_pauses.cpu_s
    heart.callbacks = callbacks
    if sampler is not None:
        sampler.stopped.set()
        sampler.join()
    return heart, counts, sampler


def summarise_beats(heart: Heartbeat) -> dict[str, float]:
    late = heart.late_s
    worst = max(range(len(late)), key=late.__getitem__)
    own = [max(0.0, lag - runq) for lag, runq in zip(late, heart.runq_s)]
    unwaited = [max(0.0, lag - runq) for lag, runq in zip(late, heart.any_runq_s)]
    return {
        "max_ms": 1000 * late[worst],
        "p99_ms": 1000 * statistics.quantiles(late, n=100)[98],
        "p50_ms": 1000 * statistics.median(late),
        "max_cpu_ms": 1000 * heart.cpu_s[worst],
        "max_runq_ms": 1000 * heart.runq_s[worst],
        # Lateness less the loop thread's wait for a core: what this process itself caused
        # (the loop's own work, waits for the GIL), with the machine's other load taken out.
        "own_max_ms": 1000 * max(own),
        "own_p99_ms": 1000 * statistics.quantiles(own, n=100)[98],
        # ... less the longest wait for a core of any of its threads (the GIL's holder too).
        "unwaited_max_ms": 1000 * max(unwaited),
        "loop_cpu_max_ms": 1000 * max(heart.cpu_s),
        "loop_cpu_p99_ms": 1000 * statistics.quantiles(heart.cpu_s, n=100)[98],
        "max_gc_ms": 1000 * max(heart.gc_pauses_s, default=0.0),
        "max_gc_cpu_ms": 1000 * max(heart.gc_cpu_s, default=0.0),
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
    parser.add_argument("--cancel", type=float, default=0.1, help="fraction of calls cancelled")
    parser.add_argument(
        "--malformed", type=float, default=0.01, help="fraction of calls with a bad prompt"
    )
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
    rows, stacks, slowest = [], collections.Counter(), []
    try:
        asyncio.run(
            soak(
                lm,
                clients=args.clients,
                seconds=min(1.0, args.seconds),
                seed=args.seed,
                sampler_ms=None,
                cancel=args.cancel,
                malformed=args.malformed,
            )
        )
        idle, _, _ = asyncio.run(
            soak(lm, clients=0, seconds=min(2.0, args.seconds), seed=args.seed, sampler_ms=None)
        )
        # the floor: no clients
        rows.append({"repeat": "idle", **summarise_beats(idle), "requests": 0})
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
                    cancel=args.cancel,
                    malformed=args.malformed,
                )
            )
            if profiler is not None:
                profiler.disable()
            cpu = time.thread_time()
            gc.collect()  # what a full collection would hold the GIL for now (outside a beat)
            full_gc_cpu_ms = 1000 * (time.thread_time() - cpu)
            rows.append(
                {
                    "repeat": repeat,
                    **summarise_beats(heart),
                    "full_gc_now_cpu_ms": full_gc_cpu_ms,
                    "requests": sum(counts[op] for op in OPERATIONS),
                    **counts,
                }
            )
            if sampler is not None:
                stacks.update(sampler.counts)
            slowest = sorted([*slowest, *heart.callbacks.slowest], key=lambda r: -r[0])[:12]
            print(
                f"repeat {repeat}: max {rows[-1]['max_ms']:.1f} ms, "
                f"p99 {rows[-1]['p99_ms']:.2f} ms",
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
        "own_max_ms": max(r["own_max_ms"] for r in soaks),
        "own_p99_ms": statistics.median(r["own_p99_ms"] for r in soaks),
        "unwaited_max_ms": max(r["unwaited_max_ms"] for r in soaks),
        "loop_cpu_max_ms": max(r["loop_cpu_max_ms"] for r in soaks),
        "loop_cpu_p99_ms": statistics.median(r["loop_cpu_p99_ms"] for r in soaks),
        "max_vs_idle": max(r["max_ms"] for r in soaks) / max(rows[0]["max_ms"], 1e-3),
    }
    columns = [
        "repeat",
        "max_ms",
        "p99_ms",
        "p50_ms",
        "max_cpu_ms",
        "max_runq_ms",
        "own_max_ms",
        "own_p99_ms",
        "unwaited_max_ms",
        "loop_cpu_max_ms",
        "loop_cpu_p99_ms",
        "max_gc_ms",
        "max_gc_cpu_ms",
        "full_gcs",
        "full_gc_now_cpu_ms",
        "beats",
        "requests",
        "next_token_logprobs",
        "batch_next_token_logprobs",
        "sample",
        "cancelled",
        "malformed",
        "max_vs_idle",
    ]
    print(
        f"backend={args.backend} model={args.model} clients={args.clients} seconds={args.seconds}"
        f" gc_freeze={args.gc_freeze} cancel={args.cancel} malformed={args.malformed}"
    )
    print_table([*rows, summary], columns)
    if stacks:
        print(
            f"\nthreads while the heartbeat was > {args.profile_ms:g} ms late "
            "(samples, every 2 ms):"
        )
        for stack, n in stacks.most_common(16):
            print(f"{n:6d}  {stack}")
    print("\nthe loop's slowest callbacks, by the loop thread's CPU time (cpu ms, wall ms):")
    for cpu_s, wall_s, what in slowest:
        print(f"{1000 * cpu_s:8.2f} {1000 * wall_s:8.2f}  {what}")
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
            "cancel": args.cancel,
            "malformed": args.malformed,
            "rows": rows,
            "summary": summary,
            "backend_stats": stats,
            "late_stacks": dict(stacks.most_common(30)),
            "slowest_callbacks": [
                {"cpu_ms": 1000 * c, "wall_ms": 1000 * w, "callback": what}
                for c, w, what in slowest
            ],
            "loop_cprofile": top[-22:],
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
