"""AsyncVirtualLM with vLLM's defaults: no environment variables, no ``__main__`` guard, a
KV cache sized for the model, and ``batch_size`` as the bound of a log-probability batch.

The test process runs vLLM as users do: the fixtures, ``tests/conftest.py`` and
``scripts/run_tests.sh`` set no vLLM variable but ``VLLM_NO_USAGE_STATS`` (telemetry). The
script test starts a process without any ``VLLM_*`` variable, as a user's first script.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm_fixtures import ON_GPU, assert_matches, front_on_shared_engine, prompts_of

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 900, 31000, 7]
# The variables whose values vLLM reads while an engine is built and that from_name needs
# other values of for its own engine: the caller reads theirs before and after.
ENGINE_VARIABLES = (
    "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_V2_MODEL_RUNNER", "VLLM_WORKER_MULTIPROC_METHOD",
)

# What a user's first script looks like: no ``if __name__ == "__main__":`` guard, no
# environment variables, vLLM's engine options. It reports what it saw as JSON.
SCRIPT = f"""
import json, os, random, sys
import numpy, psutil, torch
import vllm.envs
from genlm_backend.llm.vllm import AsyncVirtualLM

model, row_path, facts_path = sys.argv[1:4]
read = lambda: {{name: getattr(vllm.envs, name) for name in {ENGINE_VARIABLES!r}}}
environ = lambda: {{k: v for k, v in os.environ.items() if k.startswith("VLLM_")}}
facts = {{"environ_before": environ(), "reads_before": read()}}
random.seed(123), numpy.random.seed(123), torch.manual_seed(123)
lm = AsyncVirtualLM.from_name(model)
facts["draws_after_build"] = [random.random(), float(numpy.random.rand()), float(torch.rand(1))]
torch.save(lm.next_token_logprobs_sync({PROMPT!r}), row_path)
engine = lm.llm.llm_engine
config = engine.vllm_config
facts.update(
    environ_after=environ(), reads_after=read(),
    engine_core_in_process=hasattr(engine.engine_core, "engine_core"),
    child_processes=len(psutil.Process().children(recursive=True)),
    num_blocks=config.cache_config.num_gpu_blocks, block_size=config.cache_config.block_size,
    max_num_seqs=config.scheduler_config.max_num_seqs,
    max_model_len=config.model_config.max_model_len,
    rss_bytes=psutil.Process().memory_info().rss,
)
lm.cleanup()
with open(facts_path, "w") as f:
    json.dump(facts, f)
"""


@pytest.fixture(scope="module")
def script_run(tiny_model_dirs, tmp_path_factory) -> dict:
    """Runs :data:`SCRIPT` on the tiny model in a process whose environment has no ``VLLM_*``
    variable; returns its facts, its row and its output."""
    folder = tmp_path_factory.mktemp("vllm_script")
    (folder / "first_script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    row_path, facts_path = folder / "row.pt", folder / "facts.json"
    done = subprocess.run(
        [
            sys.executable,
            "first_script.py",
            str(tiny_model_dirs["base"]),
            str(row_path),
            str(facts_path),
        ],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = (done.stdout + done.stderr)[-6000:]
    if done.returncode != 0 or not facts_path.exists():
        return {"failed": f"the script exited with {done.returncode}:\n{output}"}
    return {
        "facts": json.loads(facts_path.read_text()),
        "row": torch.load(row_path),
        "output": output,
    }


def _facts(script_run) -> dict:
    assert "failed" not in script_run, script_run.get("failed")
    return script_run["facts"]


def test_a_script_without_a_main_guard_gets_exact_rows(script_run, hf_reference):
    facts = _facts(script_run)
    assert facts["engine_core_in_process"], facts
    assert facts["child_processes"] == 0, facts
    row, reference = script_run["row"], hf_reference("base", PROMPT)
    # vLLM's default dtype ("auto") runs this float32 checkpoint in bfloat16 (an 8-bit
    # mantissa): measured 0.05 max abs diff against the fp32 forward pass, on log-probabilities
    # of about -20; 0.25 leaves room, and the five likeliest tokens are the same ones.
    assert_matches(row, reference, atol=0.25)
    assert abs(torch.logsumexp(row, 0).item()) < 1e-4
    assert set(row.topk(5).indices.tolist()) == set(reference.topk(5).indices.tolist())


def test_building_the_engine_leaves_the_callers_environment_as_it_was(script_run):
    facts = _facts(script_run)
    # (vLLM sets variables of its own as any engine starts, VLLM_DIST_IDENT on a CPU among
    # them, as a plain vllm.LLM does: those are left to it.)
    ours = {name: facts["environ_after"].get(name) for name in ENGINE_VARIABLES}
    assert facts["environ_before"] == {} and ours == dict.fromkeys(ENGINE_VARIABLES)
    # vLLM caches the variables it reads once an engine has started: the cache holds the
    # caller's values, not the ones the engine was built with.
    assert facts["reads_after"] == facts["reads_before"]


def test_requests_reach_the_engine_in_the_form_it_expects(script_run):
    """vLLM 0.32 deprecates raw prompts to its input processor (one warning per process):
    requests and sessions give it prompts in its engine's own form."""
    _facts(script_run)
    assert "Passing raw prompts" not in script_run["output"]


def test_building_the_engine_leaves_the_callers_random_generators_as_they_were(script_run):
    """vLLM seeds Python's, numpy's and torch's global generators as its engine starts (with
    its ``seed``, 0 by default); the caller's generators continue where they were."""
    import numpy

    expected = [
        random.Random(123).random(),
        float(numpy.random.RandomState(123).rand()),
        float(torch.rand(1, generator=torch.Generator().manual_seed(123))),
    ]
    assert _facts(script_run)["draws_after_build"] == expected


@pytest.mark.skipif(ON_GPU, reason="the KV cache is sized on CPU engines only")
def test_cpu_kv_cache_fits_every_sequence_at_full_length_and_no_more(script_run):
    facts = _facts(script_run)
    tokens = facts["num_blocks"] * facts["block_size"]
    needed = facts["max_num_seqs"] * facts["max_model_len"]
    # vLLM's default asks for 90% of the machine's memory (a 12 GiB cache for this model
    # where that much is free, or a refusal to start).
    assert needed <= tokens <= 2 * needed + 4 * facts["block_size"]
    assert facts["rss_bytes"] < 3 * 2**30


@pytest.mark.skipif(ON_GPU, reason="the KV cache is sized on CPU engines only")
def test_the_shared_test_engine_runs_in_this_process_with_a_small_kv_cache(vllm_lm):
    engine = vllm_lm.llm.llm_engine
    assert hasattr(engine.engine_core, "engine_core")  # the engine core is in this process
    config = engine.vllm_config
    tokens = config.cache_config.num_gpu_blocks * config.cache_config.block_size
    needed = config.scheduler_config.max_num_seqs * config.model_config.max_model_len
    assert needed <= tokens <= 2 * needed + 4 * config.cache_config.block_size
    # 2 layers x 1 KV head x 64 x (K, V) x fp32: 1 KiB a token.
    assert config.cache_config.kv_cache_memory_bytes <= 2 * needed * 1024 + 2**20


@pytest.mark.skipif(ON_GPU, reason="the KV cache is sized on CPU engines only")
def test_the_callers_kv_cache_size_wins(tiny_model_dirs, hf_reference):
    from genlm_backend.llm.vllm import AsyncVirtualLM

    size = 24 * 2**20
    lm = AsyncVirtualLM.from_name(
        str(tiny_model_dirs["base"]),
        engine_opts={"dtype": "float32", "max_model_len": 128, "kv_cache_memory_bytes": size},
    )
    try:
        cache = lm.llm.llm_engine.vllm_config.cache_config
        assert cache.kv_cache_memory_bytes == size
        assert cache.num_gpu_blocks * cache.block_size >= size // 1024 - cache.block_size
        assert_matches(lm.next_token_logprobs_sync(PROMPT), hf_reference("base", PROMPT))
    finally:
        lm.cleanup()


def test_kv_sizing_follows_the_model_and_the_engine_limits(tiny_model_dirs):
    from genlm_backend.llm.vllm.startup import cpu_kv_cache_bytes

    base = str(tiny_model_dirs["base"])
    per_token = 2 * 2 * 1 * 64 * 4  # (K, V) x 2 layers x 1 KV head x 64 dims x fp32
    lots = 64 * 2**30
    fp32 = {"dtype": "float32"}
    small = cpu_kv_cache_bytes(
        base, {**fp32, "max_num_seqs": 4, "max_model_len": 256}, available=lots
    )
    assert 4 * 256 * per_token <= small <= 2 * 4 * 256 * per_token
    # vLLM's CPU defaults: 256 sequences, the model's own length (512); dtype "auto" runs
    # this float32 checkpoint in a 16-bit type, whose cache takes half the bytes.
    assert (
        256 * 512 * per_token
        <= cpu_kv_cache_bytes(base, fp32, available=lots)
        < 257 * 512 * per_token
    )
    assert (
        256 * 512 * per_token // 2
        <= cpu_kv_cache_bytes(base, {}, available=lots)
        < 257 * 512 * per_token // 2
    )
    # An eighth of the available memory at most, as long as one full sequence fits.
    assert cpu_kv_cache_bytes(base, {**fp32, "max_num_seqs": 256}, available=2**26) == 2**23
    assert (
        cpu_kv_cache_bytes(base, {**fp32, "max_num_seqs": 256}, available=2**20) >= 512 * per_token
    )


def test_kv_sizing_refuses_a_sequence_that_cannot_fit_before_any_engine_starts(tiny_model_dirs):
    from genlm_backend.llm.vllm.startup import cpu_kv_cache_bytes

    with pytest.raises(ValueError, match="max_model_len") as refusal:
        cpu_kv_cache_bytes(str(tiny_model_dirs["base"]), {"max_model_len": 512}, available=2**17)
    assert "kv_cache_memory_bytes" in str(refusal.value)


def test_the_callers_kv_settings_are_left_to_vllm(tiny_model_dirs, monkeypatch):
    from genlm_backend.llm.vllm.startup import cpu_kv_cache_bytes

    base = str(tiny_model_dirs["base"])
    assert cpu_kv_cache_bytes(base, {"kv_cache_memory_bytes": 2**20}) is None
    assert cpu_kv_cache_bytes(base, {"gpu_memory_utilization": 0.5}) is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu_kv_cache_bytes(base, {}) is None


def test_engine_environment_is_set_for_the_build_and_the_callers_comes_back(monkeypatch):
    """The caller's own values, set or unset, come back after the build, also after a failed
    one; during it vLLM reads the engine's (its cache of the variables included)."""
    import vllm.envs

    from genlm_backend.llm.vllm.startup import engine_environment

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    callers = {name: os.environ.get(name) for name in ENGINE_VARIABLES}
    for failing in (False, True):
        outcome = pytest.raises(RuntimeError) if failing else contextlib.nullcontext()
        with outcome, engine_environment({"tensor_parallel_size": 2}, v1_runner=True):
            assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
            assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
            assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
            assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"  # the caller chose it
            if failing:
                raise RuntimeError("the build failed")
        assert {name: os.environ.get(name) for name in ENGINE_VARIABLES} == callers
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
        assert vllm.envs.VLLM_USE_V2_MODEL_RUNNER is None


async def test_batch_size_bounds_every_log_probability_batch(vllm_lm, hf_reference):
    """``batch_size`` below ``max_num_seqs`` (8 here): batches of at most ``batch_size``
    distinct prompts, also while sessions continue contexts from one batch to the next."""
    sizes: list[int] = []
    lm = front_on_shared_engine(vllm_lm.llm, batch_size=3)
    evaluate = lm.engine.evaluate

    def recording(requests):
        sizes.append(len(requests))
        return evaluate(requests)

    lm._logprobs_batcher.evaluate = recording
    try:
        contexts = prompts_of([4, 9, 2, 30, 7, 12, 5, 3, 16, 8], seed=11)
        for step in range(3):  # each step extends every context by one token
            rows = await asyncio.gather(*(lm.next_token_logprobs(c) for c in contexts))
            for context, row in zip(contexts, rows):
                assert_matches(row, hf_reference("base", context))
            contexts = [c + [int(row.argmax())] for c, row in zip(contexts, rows)]
        assert sum(sizes) == 30 and max(sizes) <= 3, sizes
        assert lm.stats()["num_evaluated"] == 30 and lm.stats()["num_batches"] >= 12
    finally:
        lm.cleanup()
    assert vllm_lm.next_token_logprobs_sync(PROMPT).shape == (32000,)
