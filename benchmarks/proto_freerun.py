"""A bound, not the backend: what W1 could cost if vLLM sampled each particle's token itself.

The design measured here is not built. Each particle's context would be one engine request
that vLLM decodes on its own, with async scheduling, at temperature 1: vLLM's sampler draws
the next token from the same row the capture processor hands to the particle (an exact
draw), so a particle whose draw is that token asks for a row the engine already computes.
Nothing waits inside an engine step; the particles' turn of the event loop runs beside the
engine's next step instead of between two steps.

What this script runs: N requests of the W1 prompt (``max_tokens=T``, ``ignore_eos``,
temperature 1, a seed each) whose every row the capture processor follows; an engine thread
steps the engine, reads each step's sampled tokens where the scheduler takes them from the
model runner's output (so vLLM makes no per-step request outputs), and after each step hands
the new ``(row, token)`` pairs to the event loop in one call; each particle awaits its pair, checks its context as
``next_token_logprobs`` does (the prompt checker) and appends the token. It leaves out what
the design would add: matching each particle's next request to its live engine request,
flow control when particles fall behind, and the fallback when a particle's token differs
from vLLM's (a constrained or resampled particle).

Floor: ``llm.generate`` of the same N requests on the same engine (async scheduling as set),
interleaved with the prototype; ``--vllm-floor`` also times a plain engine in a child
process, as ``bench_w1_vllm.py`` does.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/proto_freerun.py --gpu --tokenizer-dir DIR \\
        --engine-opt async_scheduling=true --repeats 7
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import (  # noqa: E402
    decode_loop, model_for, parse_args, parse_opts, start_plain_floor, vocab_size, with_switch_interval,
)
from benchmarks.common import print_table, summarise, write_json  # noqa: E402


def free_running(lm, prompt: list[int], num_particles: int, num_steps: int, seed: int,
                 kept_rows: list | None = None) -> list[list[int]]:
    """N particles served by N free-running engine requests; returns their tokens (and puts
    each particle's rows in ``kept_rows``, when given, for checks)."""
    from vllm import SamplingParams

    from genlm_backend.llm import vllm_capture, vllm_internals

    engine, sink = lm.underlying_model.llm_engine, lm._sink
    scheduler = vllm_internals._scheduler(engine)
    loop = asyncio.new_event_loop()
    inboxes: list[asyncio.Queue] = []
    rows: list[list] = [[] for _ in range(num_particles)]  # each request's rows not yet paired
    particle_of: dict[int, int] = {}  # tag -> particle
    requests = {}  # request id -> params
    for i in range(num_particles):
        tag = sink.next_tag()
        sink.follow(tag, rows[i].append)
        particle_of[tag] = i
        requests[f"free-{seed}-{i}"] = SamplingParams(
            max_tokens=num_steps, ignore_eos=True, temperature=1.0, seed=seed + i, detokenize=False,
            extra_args=sink.extra_args(tag))
    pairs: list = []

    # Each step's sampled tokens, read where the scheduler takes them from the model runner's
    # output (no per-step request outputs: the requests report only when they finish).
    update = scheduler.update_from_output

    def update_from_output(scheduler_output, output):
        for req_id, index in output.req_id_to_index.items():
            request = scheduler.requests.get(req_id)
            mark = None if request is None else (request.sampling_params.extra_args or {}).get(vllm_capture.CAPTURE_KEY)
            tokens = output.sampled_token_ids[index] if index < len(output.sampled_token_ids) else ()
            if mark is not None and tokens:
                i = particle_of[mark[1]]
                pairs.extend((i, rows[i].pop(0), token) for token in tokens)
        return update(scheduler_output, output)

    def deliver(batch: list) -> None:
        for i, row, token in batch:
            inboxes[i].put_nowait((row, token))

    def step_engine() -> None:
        previous = scheduler.__dict__.get("update_from_output")  # another wrapper, if any
        scheduler.update_from_output = update_from_output
        try:
            for request_id, params in requests.items():
                vllm_internals.add_request(engine, request_id, tuple(prompt), params, None)
            while engine.has_unfinished_requests():
                engine.step()
                if pairs:
                    batch = pairs[:]
                    pairs.clear()
                    loop.call_soon_threadsafe(deliver, batch)
        finally:
            if previous is None:
                del scheduler.update_from_output
            else:
                scheduler.update_from_output = previous

    async def particle(i: int) -> list[int]:
        context = list(prompt)
        for _ in range(num_steps):
            lm._request(context, None)  # what next_token_logprobs checks of each context
            row, token = await inboxes[i].get()
            if kept_rows is not None:
                kept_rows.append((list(context), row.cpu()))
            context.append(token)
        return context[len(prompt):]

    async def main() -> list[list[int]]:
        inboxes.extend(asyncio.Queue() for _ in range(num_particles))
        thread = threading.Thread(target=step_engine)
        thread.start()
        try:
            return await asyncio.gather(*(particle(i) for i in range(num_particles)))
        finally:
            await asyncio.get_running_loop().run_in_executor(None, thread.join)

    try:
        return loop.run_until_complete(main())
    finally:
        for tag in particle_of:
            sink.unfollow(tag)
        loop.close()


def main() -> None:
    args = parse_args(sys.argv[1:])
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, engine_opts = model_for(args)
    engine_opts["seed"] = args.seed
    engine_opts.update(parse_opts(args.engine_opt))
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)]
    plain = start_plain_floor(args, model_dir, engine_opts, prompt)
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=engine_opts, sessions=False)
    llm = lm.underlying_model
    scheduler_config = llm.llm_engine.vllm_config.scheduler_config
    results = []
    try:
        for n in args.particles:
            def floor(n=n) -> None:
                decode_loop(llm, prompt, n, args.steps)

            def proto(n=n) -> None:
                tokens = free_running(lm, prompt, n, args.steps, args.seed)
                assert all(len(t) == args.steps for t in tokens)

            variants = {"proto": proto, "floor": floor}
            if args.ab_switch_interval:
                variants["proto_si"] = with_switch_interval(args.ab_switch_interval, proto)
            if plain is not None:
                variants["vllm_floor"] = lambda n=n: plain.generate(n)
            times = {name: [] for name in variants}
            for fn in variants.values():
                fn()  # warm-up
            for _ in range(args.repeats):
                for name, fn in variants.items():
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            summary = {name: summarise(t) for name, t in times.items()}
            row = {"N": n, "T": args.steps, "proto_s": summary["proto"]["median_s"],
                   "floor_s": summary["floor"]["median_s"],
                   "ratio": statistics.median(p / f for p, f in zip(times["proto"], times["floor"])), **summary}
            if args.ab_switch_interval:
                row["proto_si_s"] = summary["proto_si"]["median_s"]
            if plain is not None:
                row["floor_vllm_s"] = summary["vllm_floor"]["median_s"]
                row["ratio_vllm"] = row["proto_s"] / row["floor_vllm_s"]
                if args.ab_switch_interval:
                    row["ratio_vllm_si"] = row["proto_si_s"] / row["floor_vllm_s"]
            print(f"N={n}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_s") or "ratio" in k),
                  flush=True)
            results.append(row)
    finally:
        if plain is not None:
            plain.close()
        lm.cleanup()
    columns = [c for c in ("N", "T", "proto_s", "proto_si_s", "floor_s", "ratio", "floor_vllm_s", "ratio_vllm",
                           "ratio_vllm_si") if c in results[0]]
    print(f"async_scheduling={scheduler_config.async_scheduling}")
    print_table(results, columns)
    name = "proto_freerun_gpu" if args.gpu else "proto_freerun_cpu"
    print("wrote", write_json(name, {"config": {k: str(v) for k, v in vars(args).items()},
                                     "async_scheduling": bool(scheduler_config.async_scheduling),
                                     "rows": results}, args.out_dir))


if __name__ == "__main__":
    main()
