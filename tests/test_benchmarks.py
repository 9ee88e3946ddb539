"""The benchmark suite runs end to end in quick mode and every workload leaves sane results.

One run of ``python -m benchmarks --quick`` (a few minutes on two cores; it starts four
vLLM engines) into a temporary folder, shared by the checks below. Each checks a workload's
JSON: the machine is recorded, every time is positive, and every ratio is the one its
recorded times give; and that its PNG is a PNG.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Quick-mode figures are recomputed from the recorded times: equal up to float rounding.
REL = 1e-9

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="the suite's W1 and W2 need vLLM"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("matplotlib") is None, reason="the suite plots with matplotlib"
    ),
]


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Runs the quick suite once; returns (output folder, captured stdout)."""
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--out-dir", str(out)],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return out, done.stdout


def load(out: Path, name: str, rows: str = "rows") -> dict:
    payload = json.loads((out / f"{name}.json").read_text())
    assert payload["workload"] == name
    assert payload["machine"]["cpu_count"] >= 1 and payload["machine"]["torch"]
    assert payload[rows], f"{name} recorded no {rows}"
    png = (out / f"{name}.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    return payload


def same(a: float, b: float) -> bool:
    return a == pytest.approx(b, rel=REL)


def check_summary(summary: dict) -> None:
    for key in ("median_s", "min_s", "max_s"):
        assert summary[key] > 0
    assert summary["min_s"] <= summary["median_s"] <= summary["max_s"]


def test_every_workload_ran_and_the_summary_lists_it(suite):
    out, stdout = suite
    summary = json.loads((out / "suite.json").read_text())
    names = [w["workload"] for w in summary["workloads"]]
    assert names == ["w1-vllm", "w1-hf", "w2", "w3", "w4", "memory", "heartbeat"]
    assert all("error" not in w and w["returncode"] == 0 for w in summary["workloads"])
    assert {h["workload"] for h in summary["headlines"]} == set(names)
    for line in summary["headlines"]:
        assert (
            line["ours"] > 0
            and line["floor"] > 0
            and same(line["ratio"], line["ours"] / line["floor"])
        )
    assert "=== summary" in stdout


def test_w1_and_w5_vllm(suite):
    payload = load(suite[0], "smc_vllm_cpu", rows="tables")
    assert set(payload["tables"]) == {"w1", "w5"}
    for rows in payload["tables"].values():
        assert [r["N"] for r in rows] == [1, 4]
        for row in rows:
            assert row["floor_s"] > 0 and row["own_engine_floor_s"] > 0 and row["sample_s"] > 0
            assert 0 < row["wall_min_s"] <= row["wall_s"] <= row["wall_max_s"]
            assert same(row["ratio"], row["wall_s"] / row["floor_s"])
            # Each run's wall time less its own sampling time is below its wall time, so
            # the median of the one is below the median of the other.
            assert 0 < row["ratio_nosample"] < row["ratio"]
    # The floor: a plain engine with vLLM's defaults, in its own process.
    assert isinstance(payload["config"]["floor_async_scheduling"], bool)
    assert payload["stats"]["num_requests"] > 0


def test_w1_hf(suite):
    payload = load(suite[0], "w1_hf_cpu")
    for row in payload["rows"]:
        assert all(t > 0 for t in row["wall_times"] + row["floor_times"])
        assert same(row["wall_s"], statistics.median(row["wall_times"]))
        assert same(row["floor_s"], statistics.median(row["floor_times"]))
        assert same(row["ratio"], row["wall_s"] / row["floor_s"])


def test_w2_sampling(suite):
    payload = load(suite[0], "w2_sampling_cpu")
    for row in payload["rows"]:
        assert row["tokens_match"] and row["num_tokens"] == row["P"] * row["T"]
        assert row["samples_match"]  # same seeds and parameters as the floor: same tokens
        check_summary(row["floor"])
        assert same(row["floor_s"], statistics.median(row["floor"]["times"]))
        for variant in ("batch_sample", "sample"):
            check_summary(row[variant])
            times = row[variant]["times"]
            assert same(row[f"{variant}_s"], statistics.median(times))
            assert same(row[f"{variant}_tok_s"], row["num_tokens"] / row[f"{variant}_s"])
            assert same(row[f"{variant}_ratio"], row["floor_s"] / row[f"{variant}_s"])
            paired = [f / t for f, t in zip(row["floor"]["times"], times)]
            assert same(row[f"{variant}_ratio_min"], min(paired)) and same(
                row[f"{variant}_ratio_max"], max(paired)
            )


def test_w3_trie(suite):
    payload = load(suite[0], "w3_trie")
    for row in payload["rows"]:
        assert 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        if "floor_ms" in row:
            assert same(row["x_floor"], row["median_ms"] / row["floor_ms"])


def test_w4_decode_vocab(suite):
    payload = load(suite[0], "w4_decode_vocab")
    baseline = {
        r["vocabulary"]: r["median_s"] for r in payload["rows"] if r["method"] != "decode_vocab"
    }
    for row in payload["rows"]:
        assert row["same_bytes"] and 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
        assert same(row["speedup"], baseline[row["vocabulary"]] / row["median_s"])


def test_memory(suite):
    payload = load(suite[0], "memory_cpu")
    for row in payload["rows"]:
        floor = row["floor_bytes_per_1000"]
        assert floor == 4 * row["V"] * 1000
        # Every cached row is a compact fp32 [V] tensor: exactly the floor.
        assert all(f["num_cached"] == row["rows"] for f in row["fills"])
        assert same(row["tensor_per_1000"], floor) and same(row["tensor_ratio"], 1.0)
        # Resident memory also moves with the allocator's free lists: at quick sizes (a few
        # hundred rows) it is only checked for consistency, not against the floor.
        assert same(row["rss_ratio"], row["rss_per_1000"] / floor)
        assert row["kv_per_1000"] > 0 and same(
            row["kv_ratio"], row["kv_cache_bytes"] / row["kv_floor_bytes"]
        )
        assert row["fill_s"] > 0


def test_heartbeat(suite):
    payload = load(suite[0], "heartbeat_hf")
    idle, *soaks = payload["rows"]
    assert idle["repeat"] == "idle" and idle["requests"] == 0 and len(soaks) == 1
    for row in payload["rows"]:
        assert row["max_ms"] >= row["p99_ms"] >= row["p50_ms"] > 0 and row["beats"] > 0
    assert all(row["requests"] > 0 for row in soaks)
    summary = payload["summary"]
    assert same(summary["max_ms"], max(row["max_ms"] for row in soaks))
    assert same(summary["max_vs_idle"], summary["max_ms"] / idle["max_ms"])
