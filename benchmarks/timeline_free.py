"""A diagnostic: W1 with free-running sessions, one line per engine step, to see why ours
runs more engine steps than vLLM's decode loop (``llm.generate``) for the same rows.

For one run per N it prints each engine step of ours: why the pump ran it (``idle``: the
event loop ran out of work with requests waiting; ``batch``: a batch arrived; ``again``:
a request still waited after its step; ``ahead``: a lookahead ticket), the tickets left,
the requests waiting before it, what vLLM scheduled in it (new requests; tokens of requests
given more than one, and of those given one: decodes, and new requests whose prompt but the
last token was cached), the tokens the tap saw, the rows it handed to waiting requests (rows
taken at once on the event loop are not counted), and whether it ran the model. Then the
counts by reason, beside the floor's count of steps that ran the model (with async
scheduling, a step runs the model for the next rows and hands out the last step's).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/timeline_free.py --gpu --tokenizer-dir DIR \\
        --engine-opt async_scheduling=true --sampler batched --particles 8 64
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/timeline_free.py --micro --steps 32 \\
        --sampler batched --particles 8 64
"""

from __future__ import annotations

import asyncio
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import decode_loop, lockstep_smc, model_for, parse_args, parse_opts  # noqa: E402


class Timeline:
    """Per engine step: the pump's state and vLLM's schedule."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.reason = "ahead"  # why the next pump runs (set by the wake-ups)
        self.model_runs = 0
        self.current: dict | None = None

    def install(self, driver, engine) -> None:
        from genlm_backend.llm import vllm_internals

        timeline = self
        pump, wake, start_batch = driver._pump, driver._wake, driver._start_batch
        in_batch = False

        def on_wake():  # on the engine thread, from an idle loop's probe or a batch
            timeline.reason = "batch" if in_batch else "idle"
            return wake()

        def on_start_batch(requests, batch):
            nonlocal in_batch
            in_batch = True
            try:
                return start_batch(requests, batch)
            finally:
                in_batch = False

        def on_pump():
            sessions = driver.sessions
            waiting = sum(s.waiting is not None for s in sessions._by_tag.values())
            entry = {"reason": timeline.reason, "tickets": driver._tickets, "waiting": waiting, "tapped": 0,
                     "served": 0, "new": 0, "prefill": 0, "decode": 0, "model": False}
            timeline.current = entry
            give = sessions._give

            def counted(waiting, result):
                entry["served"] += 1
                return give(waiting, result)

            sessions._give = counted
            before_steps = sessions.steps
            try:
                pump()
            finally:
                sessions._give = give
                timeline.current = None
            if sessions.steps != before_steps:
                timeline.steps.append(entry)
                timeline.reason = "again" if driver._tickets == 1 and entry["tickets"] == 1 else "ahead"

        tokens = driver.sessions.tokens

        def on_tokens(found):
            if timeline.current is not None:
                timeline.current["tapped"] += sum(len(t) for _, t in found)
            return tokens(found)

        driver.sessions.tokens = on_tokens
        driver._pump = on_pump
        driver._wake, driver._start_batch = on_wake, on_start_batch
        scheduler, runner = vllm_internals._scheduler(engine), vllm_internals._model_runner(engine)
        schedule, execute = scheduler.schedule, runner.execute_model

        def on_schedule(*args, **kwargs):
            out = schedule(*args, **kwargs)
            entry = timeline.current
            if entry is not None:
                entry["new"] += len(out.scheduled_new_reqs)
                for n in out.num_scheduled_tokens.values():
                    entry["decode" if n == 1 else "prefill"] += n
            return out

        def on_execute(scheduler_output, *args, **kwargs):
            if getattr(scheduler_output, "total_num_scheduled_tokens", 1) > 0:  # (vLLM calls it empty too)
                timeline.model_runs += 1
                if timeline.current is not None:
                    timeline.current["model"] = True
            return execute(scheduler_output, *args, **kwargs)

        scheduler.schedule, runner.execute_model = on_schedule, on_execute


def main() -> None:
    args = parse_args([a for a in sys.argv[1:]] + ["--sessions", "free"])
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, opts = model_for(args)
    opts.update(parse_opts(args.engine_opt))
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts={**opts, "seed": 0}, batch_size=max(args.particles),
                                  session_lookahead=args.session_lookahead)
    llm = lm.underlying_model
    prompt = [100 + i % (lm.vocab_size - 100) for i in range(args.prompt_len)]
    timeline = Timeline()
    timeline.install(lm._free, llm.llm_engine)  # before the token tap goes in (it keeps the method it is given)
    lm.set_sessions("free")

    for n in args.particles:
        asyncio.run(lockstep_smc(lm, prompt, n, args.steps, 0, args.sampler))  # warm-up
        lm.close_sessions()
        lm._engine_thread.submit(decode_loop, llm, prompt, n, args.steps).result()
        timeline.steps.clear()
        timeline.model_runs = 0
        asyncio.run(lockstep_smc(lm, prompt, n, args.steps, 0, args.sampler))
        ours_runs = timeline.model_runs
        steps = list(timeline.steps)
        lm.close_sessions()
        timeline.model_runs = 0
        lm._engine_thread.submit(decode_loop, llm, prompt, n, args.steps).result()
        floor_runs = timeline.model_runs
        print(f"\nN={n}, T={args.steps}, lookahead {args.session_lookahead}: "
              f"ours {len(steps)} steps, {ours_runs} ran the model; floor {floor_runs}")
        print(f"  {'#':>3s} {'reason':6s} {'tickets':>7s} {'waiting':>7s} {'new':>4s} {'prefill':>7s} "
              f"{'decode':>6s} {'tapped':>6s} {'served':>6s} model")
        for i, s in enumerate(steps):
            print(f"  {i:3d} {s['reason']:6s} {s['tickets']:7d} {s['waiting']:7d} {s['new']:4d} {s['prefill']:7d} "
                  f"{s['decode']:6d} {s['tapped']:6d} {s['served']:6d} {'yes' if s['model'] else 'no'}")
        counts = collections.Counter(s["reason"] for s in steps)
        unused = sum(1 for s in steps if s["model"] and s["served"] == 0)
        print(f"  by reason: {dict(counts)}; steps that ran the model and served nobody: {unused}")
        sys.stdout.flush()
    lm.cleanup()


if __name__ == "__main__":
    main()
