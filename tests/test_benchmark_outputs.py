"""Benchmark runs write into a scratch folder unless told otherwise: the figures of record in
``benchmarks/results`` are replaced only by a run that names that folder."""

from __future__ import annotations

from pathlib import Path

from benchmarks import common, suite

REPO = Path(__file__).resolve().parents[1]


def test_the_suite_writes_into_the_scratch_folder_by_default():
    out_dir = suite.parse_args([]).out_dir
    assert out_dir == (REPO / "benchmark-out").resolve()
    assert out_dir != (REPO / "benchmarks" / "results").resolve()
    asked = suite.parse_args(["--out-dir", str(common.RESULTS_DIR)]).out_dir
    assert asked == common.RESULTS_DIR.resolve()


def test_scripts_write_into_the_scratch_folder_by_default(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "SCRATCH_DIR", tmp_path / "scratch")
    assert common.write_json("probe", {"rows": []}) == tmp_path / "scratch" / "probe.json"
    assert common.write_json("probe", {}, tmp_path / "asked") == tmp_path / "asked" / "probe.json"


def test_the_scratch_folder_is_ignored_by_git():
    assert "/benchmark-out/" in (REPO / ".gitignore").read_text().splitlines()
