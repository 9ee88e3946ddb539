"""The front's own time per particle-step (µs), by stage, on the W1 loop.

W1: N particles; each step, one ``asyncio.gather`` of ``lm.next_token_logprobs(context)``
over the particles, then the user extends every context by one token. The engine's time
(``evaluate``, and for vLLM the engine thread's work until the rows are back) and the
user's step are taken out: what is left is this process's front.

Two passes per run:
    * ``total``: no timing hooks but one per batch (the engine) and the collector's
      callback: (step wall - engine - user step) / N, the mean over the steps (the
      collector's full passes are rare and long: a median over steps would hide them).
      The figure of record; ``cpu``: the loop thread's CPU time per particle-step (what
      other processes on the machine do not inflate; the engine thread's work is not in it,
      nor the collector's passes that thread triggers).
    * ``staged``: ``perf_counter_ns`` around each stage (each hook adds ~0.1-0.2 µs), the
      collector's passes inside a stage taken out of it:
        - ``request``: ``AsyncLM._request`` (closed check, ``PromptChecker.request``);
        - ``enqueue``: ``Batcher.enqueue`` (entry, future, dedup tables, triggers);
        - ``tasks``: the rest of the way from the step's start to the last enqueue:
          gather's tasks, their first steps, the coroutine of ``next_token_logprobs``;
        - ``hand_off``: last enqueue -> engine start, and engine end -> ``finish`` start
          (idle probe, thread hop), per batch, spread over N;
        - ``plan``: with vLLM, ``evaluate``'s own time on the loop (the batch made into the
          engine's input, handed to the engine thread);
        - ``hand_over``: ``LoopQueue.finish`` (each future's result);
        - ``wake``: ``finish`` end -> gather's result (every task resumed and done);
        - ``gc``: the collector's time inside the steps.
    ``cprofile`` (``--profile``) prints the top functions of one N instead.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/diagnostics/front_cost.py \
        [--backend mock|vllm] [--particles 64 256 1024] [--steps 32] [--runs 5] \
        [--gc-freeze] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

ns = time.perf_counter_ns
STAGES = ("request", "enqueue", "tasks", "hand_off", "plan", "hand_over", "wake", "gc")


class Hooks:
    """Timestamps of one step, filled by wrappers installed on one model."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.request_ns = self.enqueue_ns = self.gc_ns = self.plan_ns = 0
        self.last_enqueue = self.finish_start = self.finish_end = self.first_evaluate = 0
        self.engine = []  # (start, end) of each batch's engine work
        self.gc_start = self.gc_at_last_enqueue = 0
        self.gc_at_finish_start = self.gc_at_finish_end = 0
        self.gc_at_first_evaluate = self.gc_at_engine_end = 0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_start = ns()
        elif self.gc_start:
            self.gc_ns += ns() - self.gc_start
            self.gc_start = 0


def install(lm: Any, hooks: Hooks, staged: bool) -> None:
    """Wraps the model's stages (instance attributes shadow the methods)."""
    batcher = lm._logprobs_batcher
    evaluate = batcher.__dict__.get("_plain_evaluate") or batcher.evaluate
    batcher._plain_evaluate = evaluate

    # Every engine's evaluate runs on the loop and hands the batch over, returning a future
    # that is done when the rows are back (seen from ``finish``).
    def timed_evaluate(keys):
        start = ns()
        if not hooks.first_evaluate:
            hooks.first_evaluate, hooks.gc_at_first_evaluate = start, hooks.gc_ns
        try:
            return evaluate(keys)
        finally:
            end = ns()
            hooks.plan_ns += end - start
            hooks.engine.append([end, 0])
            hooks.gc_at_engine_end = hooks.gc_ns

    batcher.evaluate = timed_evaluate
    for name in ("_request", "enqueue"):
        lm.__dict__.pop(name, None)
        batcher.__dict__.pop(name, None)
    if not staged:
        return
    plain_request = lm._request
    plain_enqueue = batcher.enqueue

    def request(token_ids, lora_name):
        start, gc_ns = ns(), hooks.gc_ns
        out = plain_request(token_ids, lora_name)
        hooks.request_ns += ns() - start - (hooks.gc_ns - gc_ns)
        return out

    def enqueue(key):
        start, gc_ns = ns(), hooks.gc_ns
        out = plain_enqueue(key)
        end = hooks.last_enqueue = ns()
        hooks.gc_at_last_enqueue = hooks.gc_ns
        hooks.enqueue_ns += end - start - (hooks.gc_ns - gc_ns)
        return out

    lm._request = request
    batcher.enqueue = enqueue


def hook_finish(lm: Any, hooks: Hooks) -> None:
    loop = asyncio.get_running_loop()
    queue = lm._logprobs_batcher._queues[loop]
    plain_finish = type(queue).finish.__get__(queue)

    def finish(batch, results, error, seconds):
        start = hooks.finish_start = ns()
        hooks.gc_at_finish_start = hooks.gc_ns
        if hooks.engine and not hooks.engine[-1][1]:
            hooks.engine[-1][1] = start
        plain_finish(batch, results, error, seconds)
        hooks.finish_end = ns()
        hooks.gc_at_finish_end = hooks.gc_ns

    queue.finish = finish


async def w1(lm: Any, prompt: list[int], n: int, steps: int, hooks: Hooks,
             staged: bool) -> list[dict[str, float]]:
    """The W1 loop; per step, the stages' nanoseconds."""
    contexts = [list(prompt) for _ in range(n)]
    vocab = lm.vocab_size
    await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))  # makes the queue
    hook_finish(lm, hooks)
    out = []
    for t in range(steps):
        hooks.reset()
        start, cpu = ns(), time.thread_time_ns()
        await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
        end, cpu = ns(), time.thread_time_ns() - cpu
        user = ns()
        # the first two tokens spell the particle's number: distinct contexts from then on,
        # as a sampler's soon are
        contexts = [c + [(i >> 8 * t if t < 2 else t * 31 + i * 7) % vocab]
                    for i, c in enumerate(contexts)]
        user = ns() - user
        engine = sum(e - s for s, e in hooks.engine)
        step = {"total": end - start - engine, "cpu": cpu, "user": user, "gc": hooks.gc_ns}
        if staged:
            hand_off = (
                hooks.first_evaluate - hooks.last_enqueue
                - (hooks.gc_at_first_evaluate - hooks.gc_at_last_enqueue)
                + hooks.finish_start - hooks.engine[-1][1]
                - (hooks.gc_at_finish_start - hooks.gc_at_engine_end)
            )
            step.update(
                request=hooks.request_ns,
                enqueue=hooks.enqueue_ns,
                tasks=hooks.last_enqueue - start - hooks.gc_at_last_enqueue - hooks.request_ns
                - hooks.enqueue_ns,
                hand_off=hand_off,
                hand_over=hooks.finish_end - hooks.finish_start
                - (hooks.gc_at_finish_end - hooks.gc_at_finish_start),
                plan=hooks.plan_ns,
                wake=end - hooks.finish_end - (hooks.gc_ns - hooks.gc_at_finish_end),
            )
        out.append(step)
    return out


def make_model(backend: str, n_max: int) -> tuple[Any, list[int]]:
    if backend == "mock":
        from genlm_backend.llm.mock import MockAsyncLM

        lm = MockAsyncLM(None, vocab_size=256, batch_size=max(n_max, 20))
        return lm, list(range(1, 129))
    from benchmarks.diagnostics._w1 import parse, start

    lm, prompt = start(parse(["--micro"]))
    return lm, list(prompt)


def run(args: argparse.Namespace) -> dict[int, dict[str, dict[str, float]]]:
    lm, prompt = make_model(args.backend, max(args.particles))
    if args.gc_freeze:  # this process's choice: what a program may do once its model is built
        gc.collect()
        gc.freeze()
    hooks = Hooks()
    gc.callbacks.append(hooks.on_gc)
    per_run: dict[int, dict[str, list[float]]] = {n: {} for n in args.particles}
    try:
        for _ in range(args.runs):
            for n in args.particles:
                for staged in (False, True):
                    install(lm, hooks, staged)
                    steps = asyncio.run(w1(lm, prompt, n, args.steps, hooks, staged))
                    steps = steps[2:]  # warm-up steps
                    keys = ("total", "cpu", "user", "gc") if not staged else STAGES
                    for key in keys:  # the mean over steps: what the wall time sees
                        name = key if not staged or key != "gc" else "gc_staged"
                        fig = sum(s[key] for s in steps) / len(steps) / n / 1e3
                        per_run[n].setdefault(name, []).append(fig)
    finally:
        gc.callbacks.remove(hooks.on_gc)
        lm.cleanup()
    return {n: {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                for k, v in figs.items()} for n, figs in per_run.items()}


def profile(args: argparse.Namespace) -> None:
    import cProfile
    import pstats

    lm, prompt = make_model(args.backend, max(args.particles))
    hooks = Hooks()
    install(lm, hooks, False)
    n = args.particles[0]
    asyncio.run(w1(lm, prompt, n, 3, hooks, False))
    prof = cProfile.Profile()
    prof.enable()
    asyncio.run(w1(lm, prompt, n, args.steps, hooks, False))
    prof.disable()
    lm.cleanup()
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile_top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", choices=("mock", "vllm"), default="mock")
    parser.add_argument("--particles", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--gc-freeze", action="store_true",
        help="gc.freeze() once the model is built: the collector's full passes then skip "
        "every object made before (the libraries' own)",
    )
    parser.add_argument("--profile-top", type=int, default=30)
    args = parser.parse_args()
    if args.profile:
        profile(args)
        return
    figures = run(args)
    cols = ("total", "cpu", "gc") + STAGES[:-1] + ("gc_staged",)
    print(f"backend={args.backend} steps={args.steps} runs={args.runs} "
          f"gc_freeze={args.gc_freeze}; "
          "µs per particle-step (mean over steps), median [min-max] over runs")
    for n, figs in figures.items():
        cells = [f"{k}={figs[k]['median']:.2f}[{figs[k]['min']:.2f}-{figs[k]['max']:.2f}]"
                 for k in cols if k in figs]
        print(f"N={n}: " + " ".join(cells))


if __name__ == "__main__":
    main()
