"""W1: lockstep sequential importance sampling on AsyncVirtualLM, against vLLM's own decode loop.

N particles x T steps: every particle awaits ``next_token_logprobs`` of its own context each
step and samples its next token from that row on the device the row lives on; the batcher
turns the N awaits of a step into one engine call. The floor is vLLM's own decode loop over
the same forward passes: ``llm.generate(N copies of the prompt, max_tokens=T,
ignore_eos=True)``, timed twice: on a plain ``vllm.LLM`` with vLLM's own defaults (async
scheduling on where vLLM turns it on) in a child process, the floor of record
(``floor_vllm_s``, ``ratio_vllm``), and on our engine in this process (``floor_s``,
``ratio``; async scheduling off, our logits processor installed). Each configuration warms
up once and is repeated, interleaved; the table reports medians and the ratios.

CPU (tiny random Llama, Mistral's 32k tokenizer; a couple of minutes on 2 cores)::

    OMP_NUM_THREADS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=4 HF_HUB_OFFLINE=1 \\
        python benchmarks/bench_w1_vllm.py

GPU (random-weight 1.2B Llama, tekken 131k vocabulary, bf16; run
``benchmarks/prepare_gpu_assets.py`` first and carry ``benchmarks/assets/tekken``)::

    VLLM_ENABLE_V1_MULTIPROCESSING=0 HF_HUB_OFFLINE=1 PYTHONPATH=. \\
        python benchmarks/bench_w1_vllm.py --gpu --tokenizer-dir benchmarks/assets/tekken
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo, for `benchmarks.common`

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.common import print_table, summarise, write_json  # noqa: E402
from benchmarks.particles import SAMPLERS, ParticleDraws, time_draws  # noqa: E402

GPU_CONFIG = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192)
TINY_CONFIG = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   intermediate_size=256)
# A model whose forward pass costs next to nothing on a CPU (256 outputs, one small layer): a
# step is then all host-side work, ours and vLLM's, as on a GPU where the forward is fast.
MICRO_CONFIG = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    intermediate_size=128, vocab_size=256)


def build_model(out: Path, tokenizer_dir: Path | None, arch: dict, dtype: torch.dtype) -> Path:
    """Saves a random-weight Llama with ``arch`` and the tokenizer into ``out`` (reused if there)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:  # Mistral's 32k SentencePiece tokenizer, from mistral_common
        import shutil

        import mistral_common
        from transformers import LlamaTokenizer

        shutil.copy(Path(mistral_common.__file__).parent / "data" / "tokenizer.model.v1", out / "tokenizer.model")
        tokenizer = LlamaTokenizer.from_pretrained(str(out))
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.save_pretrained(str(out))
    config = LlamaConfig(**{"vocab_size": len(tokenizer), **arch}, max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, torch_dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(str(out))
    del model
    return out


async def lockstep_smc(lm, prompt: list[int], num_particles: int, num_steps: int, seed: int,
                       sampler: str = "multinomial") -> list[list[int]]:
    """N particles, each awaiting its next-token row every step and sampling from it."""
    draws = ParticleDraws(sampler, seed)

    async def particle(i: int) -> list[int]:
        context = list(prompt)
        for _ in range(num_steps):
            row = await lm.next_token_logprobs(context)
            context.append(await draws.draw(row))
        return context[len(prompt):]

    return await asyncio.gather(*(particle(i) for i in range(num_particles)))


def model_for(args: argparse.Namespace) -> tuple[Path, dict]:
    """The model folder (built if missing) and engine options of a W1 configuration."""
    if args.gpu:
        model_dir = build_model(Path(args.model_dir or "/tmp/w1_llama_1b"), args.tokenizer_dir, GPU_CONFIG,
                                torch.bfloat16)
        return model_dir, {"gpu_memory_utilization": 0.6, "max_model_len": 2048}
    arch = MICRO_CONFIG if args.micro else TINY_CONFIG
    default_dir = "/tmp/w1_micro_llama" if args.micro else "/tmp/w1_tiny_llama"
    model_dir = build_model(Path(args.model_dir or default_dir), args.tokenizer_dir, arch, torch.float32)
    return model_dir, {"max_model_len": 512, "dtype": "float32", **({"block_size": args.block_size} if args.block_size else {})}


def run(args: argparse.Namespace) -> dict:
    from genlm_backend.llm.vllm import AsyncVirtualLM

    model_dir, engine_opts = model_for(args)
    engine_opts["seed"] = args.seed
    engine_opts.update(parse_opts(args.engine_opt))
    max_n = max(args.particles)
    rng, vocab = random.Random(args.seed), vocab_size(model_dir)
    prompt = [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(args.prompt_len)]
    plain = start_plain_floor(args, model_dir, engine_opts, prompt)  # first: ours then finds its share free
    lm = AsyncVirtualLM.from_name(str(model_dir), engine_opts=engine_opts, batch_size=max_n)
    if args.gc_freeze:  # what vLLM does at engine start, once more after the backend's own setup
        gc.collect()
        gc.freeze()
    gc_pauses = GcPauses()
    llm = lm.underlying_model
    rows = []
    for n in args.particles:
        # Ours closes its sessions within its time (the floor's engine must be free of them;
        # closing is a cost of ours, not of vLLM's loop).
        def ours() -> None:
            asyncio.run(lockstep_smc(lm, prompt, n, args.steps, args.seed, args.sampler))
            lm.close_sessions()

        def nosess() -> None:
            lm.set_sessions(False)
            try:
                asyncio.run(lockstep_smc(lm, prompt, n, args.steps, args.seed, args.sampler))
            finally:
                lm.set_sessions(True)

        def floor() -> None:
            decode_loop(llm, prompt, n, args.steps)

        def vllm_floor() -> None:
            plain.generate(n)

        variants = {"on": [("ours", ours)], "off": [("nosess", nosess)],
                    "both": [("ours", ours), ("nosess", nosess)]}[args.sessions] + [("floor", floor)]
        if args.ab_switch_interval:  # ours again, with the GIL handed over more often
            variants.insert(1, ("ours_si", with_switch_interval(args.ab_switch_interval, ours)))
        if plain is not None:
            variants.append(("vllm_floor", vllm_floor))
        times = {name: [] for name, _ in variants}
        engine_times = {name: [] for name, _ in variants}  # inside the backend's engine calls
        gc_times = {name: [] for name, _ in variants}  # in Python's cyclic garbage collector
        for name, fn in variants:
            fn()  # warm-up
        for _ in range(args.repeats):  # interleaved, so drift hits all alike
            for name, fn in variants:
                before = lm.stats()["evaluate_s"]  # read outside the timed window
                gc_before = gc_pauses.seconds
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
                engine_times[name].append(lm.stats()["evaluate_s"] - before)
                gc_times[name].append(gc_pauses.seconds - gc_before)
        summary = {name: summarise(t) for name, t in times.items()}
        floor_s = summary["floor"]["median_s"]
        row = {"N": n, "T": args.steps, "floor_s": floor_s, **summary}
        row["gc_s"] = statistics.median(gc_times["ours" if "ours" in gc_times else "nosess"])
        row["gc_s_floor"] = statistics.median(gc_times["floor"])
        if "ours" in summary:  # where the time of a run goes: engine calls, draws, the rest
            row["engine_s"] = statistics.median(engine_times["ours"])
            stored = torch.randn(n, lm.vocab_size, device="cuda" if args.gpu else "cpu").log_softmax(-1)
            row["sample_s"] = min(time_draws(stored, n, args.steps, args.seed, args.sampler) for _ in range(2))
            row["other_us_per_request"] = 1e6 * (summary["ours"]["median_s"] - row["engine_s"] - row["sample_s"]) / (n * args.steps)
        if plain is not None:
            row["floor_vllm_s"] = summary["vllm_floor"]["median_s"]
        for name in summary:
            if name not in ("floor", "vllm_floor"):
                suffix = "" if name == "ours" else f"_{name}"
                row[f"wall_s{suffix}"] = summary[name]["median_s"]
                row[f"ratio{suffix}"] = summary[name]["median_s"] / floor_s
                if plain is not None:
                    row[f"ratio_vllm{suffix}"] = summary[name]["median_s"] / row["floor_vllm_s"]
        rows.append(row)
        print(f"N={n}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.startswith(("wall", "ratio"))),
              f"floor {floor_s:.4f} s", flush=True)
    stats = lm.stats()
    lm.cleanup()
    config = {**vars(args), "model_dir": str(model_dir), "engine_opts": engine_opts}
    if plain is not None:
        config["vllm_floor_async_scheduling"] = plain.async_scheduling
        plain.close()
    return {"config": config, "rows": rows, "stats": stats}


def with_switch_interval(seconds: float, fn):
    """``fn`` run with ``sys.setswitchinterval(seconds)`` (restored after): how long a thread
    that wants the GIL waits for one that holds it."""
    def run() -> None:
        previous = sys.getswitchinterval()
        sys.setswitchinterval(seconds)
        try:
            fn()
        finally:
            sys.setswitchinterval(previous)

    return run


def parse_opts(items: list[str]) -> dict:
    """``KEY=VALUE`` engine options; VALUE parsed as JSON when it can be."""
    opts = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            opts[key] = json.loads(value)
        except json.JSONDecodeError:
            opts[key] = value
    return opts


def decode_loop(llm, prompt: list[int], num_requests: int, steps: int) -> None:
    """vLLM's own decode loop over W1's forward passes: ``num_requests`` copies of ``prompt``,
    ``steps`` tokens each at temperature 1, no end of sequence."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=steps, ignore_eos=True, temperature=1.0, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)] * num_requests, params, use_tqdm=False)


def start_plain_floor(args: argparse.Namespace, model_dir: Path, engine_opts: dict,
                      prompt: list[int]) -> FloorProcess | None:
    """The floor of record (``--vllm-floor``): a plain engine with the workload's options and
    vLLM's own defaults otherwise, in a child process; None when it is left out."""
    if not args.vllm_floor:
        return None
    plain_opts = {**engine_opts, "enable_prefix_caching": True, "disable_log_stats": True}
    plain_opts.pop("async_scheduling", None)  # vLLM's own choice (on where it can be)
    plain_opts.pop("distributed_executor_backend", None)  # vLLM's decode loop in one process
    if args.gpu:
        plain_opts["gpu_memory_utilization"] = args.vllm_floor
    plain_opts.update(parse_opts(args.vllm_floor_opt))
    return FloorProcess(model_dir, plain_opts, prompt, args.steps)


def vocab_size(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


class FloorProcess:
    """vLLM's decode loop on a plain ``vllm.LLM`` with vLLM's own defaults, in a child process
    (two engines with CUDA graphs cannot share one process): ``generate(n)`` runs the floor's
    ``llm.generate`` of ``n`` copies of the prompt there and returns when it is done."""

    def __init__(self, model_dir: Path, opts: dict, prompt: list[int], steps: int):
        import subprocess

        setup = json.dumps({"model": str(model_dir), "opts": opts, "prompt": prompt, "steps": steps})
        self._child = subprocess.Popen([sys.executable, __file__, "--serve-floor", setup], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True)
        self.async_scheduling = json.loads(self._read())["async_scheduling"]

    def _read(self) -> str:
        while True:  # vLLM may print to stdout too: answers start with a marker
            line = self._child.stdout.readline()
            if not line:
                raise RuntimeError("the floor's process ended")
            if line.startswith("@floor "):
                return line.removeprefix("@floor ")

    def generate(self, n: int) -> None:
        self._child.stdin.write(f"{n}\n")
        self._child.stdin.flush()
        self._read()

    def close(self) -> None:
        self._child.stdin.close()
        self._child.wait(timeout=120)


def serve_floor(setup: str) -> None:
    """The child of :class:`FloorProcess`: one line in (a particle count), one line out."""
    from vllm import LLM

    setup = json.loads(setup)
    llm = LLM(setup["model"], **setup["opts"])
    async_scheduling = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    print("@floor", json.dumps({"async_scheduling": async_scheduling}), flush=True)
    for line in sys.stdin:
        decode_loop(llm, setup["prompt"], int(line), setup["steps"])
        print("@floor done", flush=True)


class GcPauses:
    """Seconds spent in Python's cyclic garbage collector since this was made."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="W1 lockstep SMC on AsyncVirtualLM vs vLLM's decode loop")
    parser.add_argument("--gpu", action="store_true", help="the 1.2B bf16 Llama with tekken (131k) on CUDA")
    parser.add_argument("--tokenizer-dir", type=Path, default=None, help="HF tokenizer folder (GPU: tekken)")
    parser.add_argument("--micro", action="store_true",
                        help="CPU: a 256-output one-layer model whose forward costs next to nothing, so a step "
                             "is host-side work only (a CPU stand-in for where a GPU run's time goes)")
    parser.add_argument("--model-dir", default=None, help="where the random model is built (reused if present)")
    parser.add_argument("--particles", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--steps", type=int, default=None, help="T (default: 32 on GPU, 8 on CPU)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 128 on GPU, 32 on CPU")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sampler", choices=SAMPLERS, default="multinomial",
                        help="how a particle draws its token from the row (client-side cost)")
    parser.add_argument("--sessions", choices=("on", "off", "both"), default="both",
                        help="time engine sessions on (ours), off (nosess) or both, interleaved")
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (CPU default: 128)")
    parser.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="extra vllm.LLM option (VALUE parsed as JSON when it can be); repeatable")
    parser.add_argument("--vllm-floor", type=float, default=0.25, metavar="GPU_SHARE",
                        help="the floor of record: vLLM's decode loop on a second, plain vllm.LLM with vLLM's own "
                             "defaults (async scheduling on where vLLM turns it on) and the workload's options, in a "
                             "child process, interleaved with the others (columns floor_vllm_s, ratio_vllm); "
                             "GPU_SHARE is its gpu_memory_utilization (default 0.25, so that both engines fit: the "
                             "KV cache's size does not change a step's time here); 0 leaves it out")
    parser.add_argument("--vllm-floor-opt", action="append", default=[], metavar="KEY=VALUE",
                        help="an option of --vllm-floor's engine (VALUE parsed as JSON when it can be), e.g. "
                             "async_scheduling=false")
    parser.add_argument("--gc-freeze", action="store_true",
                        help="gc.freeze() after the model is built (as vLLM does at engine start)")
    parser.add_argument("--ab-switch-interval", type=float, default=None, metavar="S",
                        help="also time ours with sys.setswitchinterval(S) (variant ours_si; the default is "
                             "5 ms: a thread waiting for the GIL, the engine's or the event loop's, may wait "
                             "that long)")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 32 if args.gpu or args.micro else 8
    if args.prompt_len is None:
        args.prompt_len = 128 if args.gpu or args.micro else 32
    if args.gpu and args.tokenizer_dir is None:
        parser.error("--gpu needs --tokenizer-dir (run benchmarks/prepare_gpu_assets.py)")
    return args


def main(argv: list[str] | None = None) -> dict:
    """Runs W1 with the command-line flags ``argv``, prints the table, writes the JSON."""
    args = parse_args(argv)
    result = run(args)
    columns = [c for c in ("N", "T", "wall_s", "wall_s_nosess", "floor_s", "ratio", "ratio_nosess", "floor_vllm_s",
                           "ratio_vllm", "ratio_vllm_nosess", "engine_s",
                           "sample_s", "gc_s", "gc_s_floor", "other_us_per_request")
               if c in result["rows"][0]]
    print_table(result["rows"], columns)
    name = "w1_vllm_gpu" if args.gpu else "w1_vllm_cpu_micro" if args.micro else "w1_vllm_cpu"
    print("wrote", write_json(name, result, args.out_dir))
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve-floor"]:
        serve_floor(sys.argv[2])
    else:
        main()
