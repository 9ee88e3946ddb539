"""How fast W1 could run if a held step were scheduled ahead of the user's tokens (GPU only).

Held sessions today run one step after another: the rows of step n reach the user, the user's
tokens come back, and only then does vLLM record step n, schedule step n+1 and prepare its
inputs, all on the host while the GPU waits. vLLM's async scheduling (its default on a GPU,
on in the floor) schedules step n+1 while step n computes, with placeholders for step n's
tokens that the model runner fills on the device from step n's sampler output.

This measures that design on vLLM's own loop, with no backend in between: an engine with
async scheduling, where

- the sampler is replaced: a step's rows are log-softmaxed (as the capture does) and its
  "sampled" tokens are a placeholder tensor on the device;
- the model runner, when it prepares step n+1's input ids (after step n+1 is scheduled),
  first waits for step n's rows and runs W1's user draw on them (``torch.multinomial``, one
  ``.tolist()``), then writes the user's tokens into the placeholder;
- step n's host output carries the user's tokens, so the scheduler records (and the prefix
  cache hashes) the tokens the forward pass saw.

So the figure is a lower bound for that design in one process: the user's draw is the only
Python between the rows and the next forward pass, with no batching, session planning or
event-loop hand-off. It is timed against the floor (the same engine, its own sampler) in one
process, interleaved. A check compares the tokens vLLM recorded with the user's draws, and a
row of the last step with the same context computed afresh (and with a wrong last token).
``floor_device``: one floor run per N with the device's time of each step, from the forward
pass to the sampler's output (CUDA events), beside the step's wall time.

    python benchmarks/diagnostics/schedule_ahead.py --gpu --tokenizer-dir .gpu_assets/tekken \
        --particles 64 256 --repeats 5
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, for `benchmarks`

import torch

from benchmarks.common import SCRATCH_DIR, summarise
from benchmarks.diagnostics._w1 import parse
from benchmarks.models import vocab_size, workload
from genlm_backend.llm.vllm.internals.engine_core import _model_runner


class Step:
    __slots__ = ("placeholder", "rows", "tokens")

    def __init__(self, rows: torch.Tensor, placeholder: torch.Tensor):
        self.rows, self.placeholder, self.tokens = rows, placeholder, None


class ScheduleAhead:
    """The hooks on one in-process GPU model runner (vLLM 0.26); ``active`` turns them on."""

    def __init__(self, runner: Any):
        from vllm.v1.outputs import SamplerOutput
        from vllm.v1.worker import gpu_model_runner

        self.runner, self.active = runner, False
        self.steps: deque[Step] = deque()  # sampled, host output not yet taken
        self.draw_s = 0.0
        self.record = False  # keep the user's tokens and last rows (the check)
        self.tokens: dict[str, list[int]] = {}
        self.last_rows: dict[str, torch.Tensor] = {}
        self.reference: torch.Tensor | None = None
        self.timing = False  # record the device time of each step, forward pass to sample
        self.events: list[tuple[Any, Any]] = []
        sample, prepare, model_forward = (
            runner._sample,
            runner._prepare_input_ids,
            runner._model_forward,
        )
        output_class = gpu_model_runner.AsyncGPUModelRunnerOutput
        get_output = output_class.get_output

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self.timing:
                self.events.append(
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                )
                self.events[-1][0].record()
            return model_forward(*args, **kwargs)

        def _sample(logits: torch.Tensor, spec_decode_metadata: Any) -> Any:
            out = _sample_inner(logits, spec_decode_metadata)
            if self.timing and self.events:
                self.events[-1][1].record()
            return out

        def _sample_inner(logits: torch.Tensor, spec_decode_metadata: Any) -> Any:
            if not self.active:
                if self.record:
                    self.reference = torch.log_softmax(logits.float(), dim=-1)[-1].clone()
                return sample(logits, spec_decode_metadata)
            rows = torch.log_softmax(logits.float(), dim=-1)
            placeholder = torch.zeros((logits.shape[0], 1), dtype=torch.int32, device=logits.device)
            self.steps.append(Step(rows, placeholder))
            return SamplerOutput(sampled_token_ids=placeholder, logprobs_tensors=None)

        def prepare_input_ids(*args: Any, **kwargs: Any) -> Any:
            step = self.steps[-1] if self.active and self.steps else None
            if (
                step is not None
                and step.tokens is None
                and runner.input_batch.prev_sampled_token_ids is step.placeholder
            ):
                self._draw(step)
            return prepare(*args, **kwargs)

        def output(out_self: Any) -> Any:
            out = get_output(out_self)
            if not self.active:
                return out
            step = self.steps.popleft()
            if step.tokens is None:  # the last step: nothing was scheduled after it
                self._draw(step)
            valid = out.sampled_token_ids
            if len(valid) != len(step.tokens):
                raise RuntimeError(f"step of {len(step.tokens)} rows, host output of {len(valid)}")
            out.sampled_token_ids = [[t] if ids else [] for t, ids in zip(step.tokens, valid)]
            if self.record:
                for i, (req_id, ids) in enumerate(zip(out.req_ids, valid)):
                    if ids:
                        self.tokens.setdefault(req_id, []).append(step.tokens[i])
                        self.last_rows[req_id] = step.rows[i]
            return out

        runner._sample, runner._prepare_input_ids, runner._model_forward = (
            _sample,
            prepare_input_ids,
            forward,
        )
        output_class.get_output = output

    def _draw(self, step: Step) -> None:
        """W1's user: the step's rows (waited for first, not timed) drawn with
        ``torch.multinomial``, one ``.tolist()``; the tokens go to the placeholder."""
        torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        tokens = torch.multinomial(step.rows.softmax(-1), 1).squeeze(1).tolist()
        with torch.inference_mode():  # the placeholder is an inference tensor of the step
            step.placeholder.copy_(torch.tensor(tokens, dtype=torch.int32).unsqueeze(1))
        step.tokens = tokens
        self.draw_s += time.perf_counter() - start


def check(llm: Any, ahead: ScheduleAhead, prompt: list[int], vocab: int) -> dict[str, Any]:
    """The tokens vLLM recorded are the user's draws; a last-step row equals the row of the
    same context computed afresh (bf16 rows of other batch shapes differ a little), and
    differs from the row of the context with its last token changed."""
    from vllm import SamplingParams, TokensPrompt

    ahead.active, ahead.record = True, True
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * 4, params, use_tqdm=False)
    ahead.active = False
    recorded = sorted(tuple(o.outputs[0].token_ids) for o in outputs)
    drawn = sorted(tuple(t) for t in ahead.tokens.values())
    req_id, tokens = next(iter(ahead.tokens.items()))
    row = ahead.last_rows[req_id]
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    def fresh(context: list[int]) -> torch.Tensor:
        llm.generate([TokensPrompt(prompt_token_ids=context)], one, use_tqdm=False)
        return ahead.reference

    context = prompt + tokens[:-1]
    same = (fresh(context) - row).abs().max().item()
    wrong = (fresh(context[:-1] + [(context[-1] + 1) % vocab]) - row).abs().max().item()
    ahead.record = False
    return {"tokens_recorded_equal_drawn": recorded == drawn, "row_max_abs_diff": same,
            "row_max_abs_diff_wrong_last_token": wrong}


def main(argv: list[str] | None = None) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    args = parse(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner the backend uses
    model_dir, opts, prompt = workload(args)
    llm = LLM(str(model_dir), **{**opts, "async_scheduling": True})
    ahead = ScheduleAhead(_model_runner(llm.llm_engine))
    result: dict[str, Any] = {"check": check(llm, ahead, prompt, vocab_size(model_dir))}
    print("check:", result["check"], flush=True)

    params = SamplingParams(
        max_tokens=args.steps, ignore_eos=True, temperature=1.0, detokenize=False
    )
    walls: dict[str, dict[int, list[float]]] = {"floor": {}, "ahead": {}, "draw": {}}
    for repeat in range(args.repeats + 1):
        for n in args.particles:
            for mode in ("floor", "ahead"):
                ahead.active, ahead.draw_s = mode == "ahead", 0.0
                start = time.perf_counter()
                llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False)
                wall = time.perf_counter() - start
                ahead.active = False
                if ahead.steps:
                    raise RuntimeError(f"{len(ahead.steps)} steps without their host output")
                if repeat:
                    walls[mode].setdefault(n, []).append(wall)
                    if mode == "ahead":
                        walls["draw"].setdefault(n, []).append(ahead.draw_s)
    for n in args.particles:  # where a step's time goes: the device's part, forward pass to sample
        ahead.timing, ahead.events = True, []
        start = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False)
        wall = time.perf_counter() - start
        ahead.timing = False
        torch.cuda.synchronize()
        device_ms = [a.elapsed_time(b) for a, b in ahead.events]
        result.setdefault("floor_device", []).append({
            "N": n, "steps": len(device_ms), "step_ms": 1e3 * wall / len(device_ms),
            "device_ms_median": statistics.median(device_ms)})
        print("floor", result["floor_device"][-1], flush=True)
    rows = []
    for n in args.particles:
        floor, mine = summarise(walls["floor"][n]), summarise(walls["ahead"][n])
        nosample = statistics.median(w - d for w, d in zip(walls["ahead"][n], walls["draw"][n]))
        row = {
            "N": n,
            "floor_s": floor,
            "ahead_s": mine,
            "draw_s": statistics.median(walls["draw"][n]),
            "ratio": mine["median_s"] / floor["median_s"],
            "ratio_nosample": nosample / floor["median_s"],
        }
        rows.append(row)
        print(
            f"N={n}: floor {row['floor_s']['median_s']:.3f} s, "
            f"ahead {row['ahead_s']['median_s']:.3f} s, "
            f"draw {row['draw_s']:.3f} s, ratio {row['ratio']:.2f}, "
            f"without the draw {row['ratio_nosample']:.2f}",
            flush=True,
        )
    result.update(
        config={
            **{k: str(v) for k, v in vars(args).items()},
            "engine_opts": opts,
            "device": torch.cuda.get_device_name(),
        },
        rows=rows,
    )
    SCRATCH_DIR.mkdir(exist_ok=True)
    out = SCRATCH_DIR / "schedule_ahead_gpu.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
