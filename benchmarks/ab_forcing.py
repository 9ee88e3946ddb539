"""W1 with the capture processor's forcing and capture as they were before 2026-11-24 (``old``,
kept here as the reference) and as they are (``new``), alternating with the floor in one
process, with timers inside the engine step: the forcing call, and the capture from its start
to the hold (``prehold``), in microseconds a step. A diagnostic of the change that cut torch
calls from both (each torch call there costs several times what it costs in a warm loop).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/ab_forcing.py --gpu --tokenizer-dir DIR \
        --particles 1 8 256 --repeats 9
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_w1_vllm import decode_loop, lockstep_smc, model_for, parse_args  # noqa: E402
from genlm_backend.llm import vllm_capture  # noqa: E402
from genlm_backend.llm.vllm_capture import CaptureSink  # noqa: E402

NEW_FORCE, NEW_CAPTURE = vllm_capture.force_tokens, CaptureSink.capture
T: dict = {}  # timer readings of the step being run, and the lists they go to


def old_force(logits, forced):
    n = len(forced)
    indices = [i for i, _ in forced]
    both = torch.tensor(indices + [t for _, t in forced], dtype=torch.int64).to(logits.device)
    tokens = both[n:].unsqueeze(1)
    if indices[-1] - indices[0] + 1 == n:
        block = logits[indices[0]: indices[-1] + 1]
        block.fill_(float("-inf"))
        block.scatter_(1, tokens, 0.0)
    else:
        index = both[:n]
        logits[index] = float("-inf")
        logits[index.unsqueeze(1), tokens] = 0.0


def old_rows_of(logits, rows, staging):
    if rows[-1] - rows[0] + 1 == len(rows):
        return logits[rows[0]: rows[-1] + 1]
    return logits.index_select(0, staging.put(rows))


def old_capture(self, logits, rows, mine_only, staging):
    T["capture_start"] = time.perf_counter()
    me = self.token
    if self.discarded is None:
        final = [(i, tag) for i, (sink, tag, out) in rows.items() if not out and (not mine_only or sink == me)]
    else:
        partial = self.discarded(logits.shape[0]).tolist()
        final = [(i, tag) for i, (sink, tag, _) in rows.items() if not partial[i] and (not mine_only or sink == me)]
    final.sort()
    followers, targets, slots = self._followers, self._targets, self._rows
    wanted = [(i, tag) for i, tag in final if tag in followers or tag in targets or tag in slots]
    if wanted:
        with torch.inference_mode(False), torch.no_grad():
            picked = old_rows_of(logits, [i for i, _ in wanted], staging)
            captured = torch.log_softmax(picked.float(), dim=-1).unbind(0)
        if self.discarded is None:
            for (_, tag), row in zip(wanted, captured):
                self.put(tag, row)
        else:
            follower, pop = followers.get, targets.pop
            for (_, tag), row in zip(wanted, captured):
                target = follower(tag) or pop(tag, None)
                if target is not None:
                    target(row)
                else:
                    self.put(tag, row)
    if self.discarded is None or self.on_step is None or not final:
        return []
    forced = self.on_step([tag for _, tag in final])
    if not forced:
        return []
    return [(i, forced_id) for i, tag in final if (forced_id := forced.get(tag)) is not None]


def new_capture(self, logits, rows, mine_only, staging):
    T["capture_start"] = time.perf_counter()
    return NEW_CAPTURE(self, logits, rows, mine_only, staging)


def timed(force, key):
    def run(logits, forced):
        t = time.perf_counter()
        force(logits, forced)
        T.setdefault(key, []).append(time.perf_counter() - t)
    return run


def main():
    args = parse_args(sys.argv[1:])
    steps, plen = args.steps or 32, args.prompt_len or 128
    from genlm_backend.llm.vllm import AsyncVirtualLM
    model_dir, opts = model_for(args)
    opts["seed"] = args.seed
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=opts, batch_size=max(args.particles))
    mode = {"which": "new"}
    inner_on_step = lm._sink.on_step
    def on_step(tags):
        start = T.pop("capture_start", None)
        if start is not None:
            T.setdefault("prehold_" + mode["which"], []).append(time.perf_counter() - start)
        return inner_on_step(tags)
    lm._sink.on_step = on_step
    rng = random.Random(args.seed)
    prompt = [rng.randrange(min(1000, lm.vocab_size // 2), lm.vocab_size) for _ in range(plen)]
    for n in args.particles:
        def ours(which):
            mode["which"] = which
            vllm_capture.force_tokens = timed(old_force if which == "old" else NEW_FORCE, "force_" + which)
            CaptureSink.capture = old_capture if which == "old" else new_capture
            try:
                asyncio.run(lockstep_smc(lm, prompt, n, steps, args.seed, args.sampler))
            finally:
                vllm_capture.force_tokens, CaptureSink.capture = NEW_FORCE, NEW_CAPTURE
        def floor():
            lm.close_sessions()
            decode_loop(lm.underlying_model, prompt, n, steps)
        variants = {"old": lambda: ours("old"), "new": lambda: ours("new"), "floor": floor}
        for fn in variants.values():
            fn()
        T.clear()
        times = {k: [] for k in variants}
        names = list(variants)
        for r in range(args.repeats):
            for name in names[r % 3:] + names[:r % 3]:
                start = time.perf_counter()
                variants[name]()
                times[name].append(time.perf_counter() - start)
        fl = statistics.median(times["floor"])
        ratios = [f"{k} {statistics.median(times[k]) / fl:.3f} ({min(times[k]) / fl:.2f}-{max(times[k]) / fl:.2f})"
                  for k in ("old", "new")]
        print(f"N={n}: floor {fl:.4f} s | " + " | ".join(ratios), flush=True)
        inside = [f"{k} {statistics.median(v) * 1e6:.1f}" for k, v in sorted(T.items()) if isinstance(v, list)]
        print("   in-context us (median): " + ", ".join(inside), flush=True)
        T.clear()
    lm.cleanup()


if __name__ == "__main__":
    main()
