"""A bound, not a backend: W1 with vLLM's engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the backend runs it) but its model runner in a
worker process (``distributed_executor_backend="mp"``, one worker).

With the model runner in this process, the particles' Python and all of vLLM's host work
take turns at one GIL. With it in a worker, only the scheduler and the output handling stay
here; preparing the inputs, launching the forward pass, the logits processors and the
sampler run in the worker, beside the particles instead of between them.

One process, two engines of the same model and options on one device (half the memory
share each), variants alternated within each repeat so that their ratios hold on a machine
whose speed moves between starts:

- ``floor``: ``LLM.generate(N copies of the prompt, max_tokens=T)`` on the engine with its
  model runner in this process: W1's floor of record.
- ``wk-floor``: the same on the engine whose model runner is in a worker.
- ``particles``, ``wk-particles``: a thread steps the engine (``LLMEngine.step``) and hands
  each step's tokens to the event loop in one call; N particle coroutines there each await
  their request's next token and do what a W1 particle does per token with free-running
  sessions: the backend's check of its context (``PromptChecker.request``), a future
  resolved for it, and a draw from a row that carries the engine's token (``offer_draw``,
  ``TokenSampler.sample``). On the in-process engine, then on the worker one.

What it leaves out: the capture of the rows and their way to this process (a device ring
shared by CUDA IPC, as ``proto_mp_rows.py`` does), and flow control (every request runs to
``max_tokens``).

    python benchmarks/bound_workers.py --gpu --tokenizer-dir DIR --engine-opt async_scheduling=true
    OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1 python benchmarks/bound_workers.py --micro --particles 8 64
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_w1_vllm import vocab_size  # noqa: E402
from benchmarks.bound_mp import run_bound  # noqa: E402

VARIANTS = ("floor", "wk-floor", "particles", "wk-particles")


class Engines:
    def __init__(self, opts: dict, prompt: list[int], steps: int, share: float | None):
        import torch
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from genlm_backend.llm.prompts import PromptChecker
        from genlm_backend.sampling import TokenSampler

        memory = {} if share is None else {"gpu_memory_utilization": share}
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        self.llm_wk = LLM(**opts, **memory, disable_log_stats=True, distributed_executor_backend="mp")
        self.llm = LLM(**opts, **memory, disable_log_stats=True)
        self.prompt = TokensPrompt(prompt_token_ids=prompt)
        self.context = list(prompt)
        base = {"max_tokens": steps, "ignore_eos": True, "temperature": 1.0, "detokenize": False}
        self.plain = SamplingParams(**base)
        self.delta = SamplingParams(**base, output_kind=RequestOutputKind.DELTA)
        self.checker = PromptChecker(vocab_size(Path(opts["model"])), None)
        self.sampler = TokenSampler(seed=0)
        self.stub = torch.zeros(8)
        self.runs = 0

    async def run(self, variant: str, n: int) -> float:
        llm = self.llm_wk if variant.startswith("wk-") else self.llm
        start = time.perf_counter()
        if variant.endswith("floor"):
            llm.generate([self.prompt] * n, self.plain, use_tqdm=False)
        else:
            await self._particles(llm, n)
        return time.perf_counter() - start

    async def _particles(self, llm, n: int) -> None:
        from genlm_backend.sampling import offer_draw

        loop = asyncio.get_running_loop()
        engine = llm.llm_engine
        self.runs += 1
        ids = [f"p{self.runs}-{i}" for i in range(n)]
        queues: dict[str, list[int]] = {i: [] for i in ids}
        waiting: dict[str, asyncio.Future] = {}

        def deliver(step: list[tuple[str, list[int]]]) -> None:
            for request_id, tokens in step:
                queues[request_id].extend(tokens)
                future = waiting.pop(request_id, None)
                if future is not None and not future.done():
                    future.set_result(None)

        def pump() -> None:
            for request_id in ids:
                engine.add_request(request_id, self.prompt, self.delta)
            while engine.has_unfinished_requests():
                step = [(out.request_id, list(out.outputs[0].token_ids)) for out in engine.step()]
                if step:
                    loop.call_soon_threadsafe(deliver, step)

        async def particle(request_id: str) -> None:
            context, checker, sampler, tokens = list(self.context), self.checker, self.sampler, queues[request_id]
            checker.request(context, None)
            for k in range(steps):
                while len(tokens) <= k:
                    waiting[request_id] = future = loop.create_future()
                    await future
                row = self.stub
                offer_draw(row, tokens[k])
                context.append(await sampler.sample(row))
                checker.request(context, None)

        steps = self.delta.max_tokens
        thread = threading.Thread(target=pump)
        thread.start()
        try:
            await asyncio.gather(*(particle(i) for i in ids))
        finally:
            await asyncio.to_thread(thread.join)

    def close(self) -> None:
        for llm in (self.llm_wk, self.llm):
            llm.llm_engine.engine_core.shutdown()


def main() -> None:
    run_bound(Engines, VARIANTS, 2)


if __name__ == "__main__":
    main()
