"""A prototype, not the backend: W1 with vLLM's engine core in its own process and every row
moved to this process, against the in-process floor, alternated in one process.

Each particle's context is one engine request (temperature 1, ``max_tokens=T``) on an
``LLM`` whose engine core runs in a child process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``).
There, a logits processor (:mod:`benchmarks.mp_ring`) writes each row's fp32 log-softmax
into a ring on the device, a lane per particle and a slot per step, which this process maps
once (CUDA IPC). A thread here steps the engine (``LLMEngine.step``: the core's outputs, a
token per request per step), gathers the rows of that step's tokens from the ring in one
copy, and hands each particle its row with the engine's draw offered on it. The particles
do what W1's particles do on free-running sessions: await the row, take the offered draw
from a ``TokenSampler``, and have the backend's prompt checker check the context.

Flow control (``ours``): the engine core writes a request's row k only once some particle
has asked for row k - ``--session-lookahead`` (the core's step waits for it, on a counter in
shared memory). ``ours_free`` lets the core run every request to its end. What it leaves out:
requests that extend a context by another token than the engine's draw, and prompts
prefilled over several steps.

A check runs with the timings: rows of a few particles and steps, as handed to them, against
a transformers forward pass of the same weights over the same contexts (the largest absolute
difference; bf16 on the GPU); and how many rows a particle's row ever arrived ahead of it.

    python benchmarks/proto_mp_rows.py --gpu --tokenizer-dir DIR --engine-opt async_scheduling=true
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/proto_mp_rows.py --micro --particles 8 64
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import vocab_size  # noqa: E402
from benchmarks.bound_mp import setup  # noqa: E402

UNLIMITED = 1 << 62  # tickets granted when the engine runs free


class Proto:
    def __init__(self, opts: dict, share: float | None, prompt: list[int], lanes: int, steps: int):
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from benchmarks.mp_ring import LANE_KEY, RING_ENV, open_ring
        from genlm_backend.llm.prompts import PromptChecker

        memory = {} if share is None else {"gpu_memory_utilization": share}
        path = os.path.join(tempfile.mkdtemp(), "ring")
        self._tickets_shm = shared_memory.SharedMemory(create=True, size=8)
        self.tickets = np.ndarray((1,), dtype=np.int64, buffer=self._tickets_shm.buf)  # rows granted per lane
        self.tickets[0] = UNLIMITED
        os.environ[RING_ENV] = f"{path}:{lanes}:{steps + 1}:{self._tickets_shm.name}"
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        self.llm_mp = LLM(**opts, **memory, disable_log_stats=True, logits_processors=["benchmarks.mp_ring:LaneRing"])
        self.ring, self._keep = open_ring(path)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        self.llm = LLM(**opts, **memory, disable_log_stats=True)
        self.prompt, self.steps = TokensPrompt(prompt_token_ids=prompt), steps
        self.context = list(prompt)
        self.plain = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=1.0, detokenize=False)
        self.params = [SamplingParams(max_tokens=steps, ignore_eos=True, temperature=1.0, detokenize=False,
                                      output_kind=RequestOutputKind.DELTA, extra_args={LANE_KEY: i})
                       for i in range(lanes)]
        self.checker = PromptChecker(vocab_size(Path(opts["model"])), None)
        self.runs = 0
        self.ahead: dict[int | None, int] = {}  # lookahead -> most rows a lane's row came ahead of its particle
        self.checked: list[tuple[list[int], object]] = []  # (context, the row the ring gave for it)

    def floor(self, n: int) -> float:
        start = time.perf_counter()
        self.llm.generate([self.prompt] * n, self.plain, use_tqdm=False)
        return time.perf_counter() - start

    async def ours(self, n: int, lookahead: int | None = None, check: bool = False) -> float:
        """One W1 run; ``lookahead``: the engine core steps only while some particle waits
        for a row, and ``lookahead`` steps ahead (None: it runs every request to its end)."""
        import torch

        from genlm_backend.sampling import TokenSampler, offer_draw

        loop = asyncio.get_running_loop()
        self.runs += 1
        run, steps, tickets = self.runs, self.steps, self.tickets
        futures = [[loop.create_future() for _ in range(steps)] for _ in range(n)]
        sampler, checker = TokenSampler(seed=run), self.checker
        seen: list[tuple[int, int, int]] = []
        handed: dict[tuple[int, int], torch.Tensor] = {}
        wanted = {(lane, k) for lane in range(min(n, 2)) for k in (0, 1, steps // 2, steps - 1)}
        tickets[0] = UNLIMITED if lookahead is None else 1 + lookahead

        taken = [0] * n  # rows each particle took

        def deliver(items: list) -> None:
            for lane, k, row, token in items:
                self.ahead[lookahead] = max(self.ahead.get(lookahead, 0), k - taken[lane])
                offer_draw(row, token)
                futures[lane][k].set_result(row)
                if check and (lane, k) in wanted:
                    handed[lane, k] = row

        def drive() -> None:
            engine, ring = self.llm_mp.llm_engine, self.ring
            for i in range(n):
                engine.add_request(f"p{run}-{i}", self.prompt, self.params[i])
            counts = [0] * n
            while engine.has_unfinished_requests():
                lanes, slots, tokens = [], [], []
                for out in engine.step():
                    lane = int(out.request_id.rsplit("-", 1)[1])
                    for token in out.outputs[0].token_ids:
                        lanes.append(lane)
                        slots.append(counts[lane])
                        tokens.append(token)
                        counts[lane] += 1
                if lanes:
                    pin = ring.is_cuda
                    index = tuple(torch.tensor(v, pin_memory=pin).to(ring.device, non_blocking=True)
                                  for v in (lanes, slots))
                    rows = ring[index].unbind(0)  # one gather: this process's own copy of the rows
                    if check:
                        seen.extend(zip(lanes, slots, tokens))
                    loop.call_soon_threadsafe(deliver, list(zip(lanes, slots, rows, tokens)))

        async def particle(i: int) -> None:
            context = list(self.context)
            checker.request(context, None)
            for k in range(steps):
                if lookahead is not None and tickets[0] < k + 1 + lookahead:
                    tickets[0] = k + 1 + lookahead  # this row, and lookahead more
                row = await futures[i][k]
                taken[i] = k + 1
                context.append(await sampler.sample(row))
                checker.request(context, None)

        start = time.perf_counter()
        thread = threading.Thread(target=drive)
        thread.start()
        await asyncio.gather(*(particle(i) for i in range(n)))
        elapsed = time.perf_counter() - start
        thread.join()
        tickets[0] = UNLIMITED
        if check:
            tokens: dict[int, list[int]] = {}
            for lane, k, token in sorted(seen):
                tokens.setdefault(lane, []).append(token)
            for (lane, k), row in sorted(handed.items()):
                self.checked.append((self.context + tokens[lane][:k], row))
        return elapsed

    def close(self) -> None:
        self.llm_mp.llm_engine.engine_core.shutdown()
        self._tickets_shm.close()
        self._tickets_shm.unlink()


async def measure(args, proto: Proto) -> list[dict]:
    rows = []
    variants = {"ours": args.session_lookahead, "ours_free": None}
    for n in args.particles:
        proto.floor(n)
        for name, lookahead in variants.items():  # warm-up, and the check
            await proto.ours(n, lookahead, check=True)
        times: dict[str, list[float]] = {"floor": [], **{name: [] for name in variants}}
        for _ in range(args.repeats):
            times["floor"].append(proto.floor(n))
            for name, lookahead in variants.items():
                times[name].append(await proto.ours(n, lookahead))
        row = {"N": n, "T": args.steps, "lookahead": args.session_lookahead,
               **{k: statistics.median(v) for k, v in times.items()}}
        for name in variants:
            ratios = [a / b for a, b in zip(times[name], times["floor"])]
            row[f"ratio_{name}"] = statistics.median(ratios)
            row[f"ratio_{name}_min_max"] = [min(ratios), max(ratios)]
        rows.append(row)
        print(f"N={n:4d}: floor {row['floor']:.4f} s; " + "; ".join(
            f"{name} {row[name]:.4f} s, ratio {row['ratio_' + name]:.2f} "
            f"({row['ratio_' + name + '_min_max'][0]:.2f}-{row['ratio_' + name + '_min_max'][1]:.2f})"
            for name in variants), flush=True)
    return rows


def check_rows(model_dir: Path, checked: list) -> float:
    """The largest difference between the ring's rows and a transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    device = checked[0][1].device
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype="auto").to(device).eval()
    worst = 0.0
    with torch.no_grad():
        for context, row in checked:
            logits = model(torch.tensor([context], device=device)).logits[0, -1]
            worst = max(worst, (torch.log_softmax(logits.float(), -1) - row).abs().max().item())
    return worst


def main() -> None:
    out, args, model_dir, opts, share, prompt = setup()
    proto = Proto(opts, None if share is None else share / 2, prompt, max(args.particles), args.steps)
    try:
        rows = asyncio.run(measure(args, proto))
    finally:
        proto.close()
    check = {"max_abs_diff": check_rows(model_dir, proto.checked), "rows": len(proto.checked),
             "most_rows_ahead": {str(k): v for k, v in proto.ahead.items()}}
    print(f"most rows a particle's row arrived ahead of it: {check['most_rows_ahead']}")
    print(f"check: {check['rows']} rows handed to particles against a transformers forward pass: "
          f"max abs difference {check['max_abs_diff']:.2e}")
    if out is not None:
        out.write_text(json.dumps({"rows": rows, "check": check}, indent=1))


if __name__ == "__main__":
    main()
