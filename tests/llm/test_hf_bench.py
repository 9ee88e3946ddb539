"""The W1 benchmark script of the Hugging Face backend runs and writes its JSON (tiny config)."""

from __future__ import annotations

import json
import statistics

import pytest

from benchmarks import bench_w1_hf


def test_w1_benchmark_smoke(tmp_path, capsys):
    payload = bench_w1_hf.main(
        [
            "--device", "cpu", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
            "--mlp", "64", "--vocab", "500", "--prompt-len", "8", "--steps", "4",
            "--particles", "1,4", "--repeats", "3", "--warmup", "1", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    written = json.loads((tmp_path / "w1_hf_cpu.json").read_text())
    assert written["workload"] == "w1_hf_cpu"
    assert [row["N"] for row in written["rows"]] == [1, 4]
    for row in payload["rows"]:
        assert row["forward_passes"] == 4  # the prompt, then one pass per step
        assert row["wall_s"] > 0 and row["floor_s"] > 0
        # Each run's engine time lies inside its wall time: what is left is never negative,
        # and it is the median over the runs of each run's own difference, per request.
        left = [w - e for w, e in zip(row["wall_times"], row["engine_times"], strict=True)]
        assert all(0 < e < w for w, e in zip(row["wall_times"], row["engine_times"]))
        per_request = 1e6 * statistics.median(left) / (row["N"] * row["T"])
        assert row["outside_engine_us_per_request"] == pytest.approx(per_request, rel=1e-12)
    assert "ratio" in capsys.readouterr().out


def test_w1_particles_follow_the_same_distribution_as_the_floor():
    """Same seed, same model: the backend's particles and the floor's sample the same tokens."""
    args = bench_w1_hf.parse_args(
        ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
         "--mlp", "64", "--vocab", "50"]
    )  # fmt: skip
    model = bench_w1_hf.build_model(args)
    from genlm_backend.llm.hf import AsyncTransformer

    prompt = list(range(8))
    with AsyncTransformer(model, bench_w1_hf.id_tokenizer(50), batch_size=4) as lm:
        ours = bench_w1_hf.run_w1(lm, prompt, 1, 6, seed=3)
    floor = bench_w1_hf.run_floor(model, prompt, 1, 6, seed=3, device="cpu")
    assert ours == floor
