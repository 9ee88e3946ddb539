"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and says what it should."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = REPO / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
RESULTS = REPO / "benchmarks" / "results"


def run_notebook(path: Path) -> str:
    """Executes ``path`` in its own folder and returns all of its text output."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", ""))
            texts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "constrained_generation.ipynb",
        "performance.ipynb",
        "quickstart.ipynb",
    ]


@pytest.mark.vllm  # the quickstart passes vLLM engine options (llm_opts={"engine_opts": ...})
def test_quickstart_runs_and_its_rows_are_normalised_and_repeatable():
    text = run_notebook(NOTEBOOK_DIR / "quickstart.ipynb")
    # "torch.Size([V]) torch.float32 <logsumexp>": a normalised fp32 row.
    match = re.search(r"torch\.Size\(\[(\d+)\]\) torch\.float32 (\S+)", text)
    assert match, text
    assert int(match.group(1)) == 49152
    assert abs(float(match.group(2))) < 1e-4
    # The sync twin gives the same row as the awaited call.
    difference = float(re.search(r"max difference: (\S+)", text).group(1))
    assert difference < 1e-5
    # The byte vocabulary reproduces the text exactly.
    assert "Hello, wörld! 🌊" in text
    # Eight particles, each with a weight; the weights sum to one.
    weights = [float(w) for w in re.findall(r"^\s*(\d\.\d{3})  '", text, flags=re.MULTILINE)]
    assert len(weights) == 8 and sum(weights) == pytest.approx(1.0, abs=0.01)


# The language of constrained_generation.ipynb, written out independently: a space, one of
# these cities, then a space or one of ".,!\n"; anything after that.
CITIES = ("Paris", "London", "Rome", "Lisbon", "Barcelona", "Tokyo", "Vienna", "Prague")
IN_LANGUAGE = re.compile(rf" ({'|'.join(CITIES)})[ .,!\n]")


def test_constrained_generation_samples_are_in_the_language_with_weights():
    text = run_notebook(NOTEBOOK_DIR / "constrained_generation.ipynb")
    # The trie's allowed mass equals the brute-force scan of the vocabulary (6 decimals).
    checks = re.findall(r"allowed mass: trie (\S+)  scan (\S+)", text)
    assert len(checks) == 3, text
    for from_trie, by_scan in checks:
        assert 0 < float(from_trie) < 1
        assert float(from_trie) == pytest.approx(float(by_scan), abs=2e-6)
    # Sixteen samples, every one in the language; the weights are normalised, and a log
    # weight (a sum of log allowed masses) is never positive.
    samples = re.findall(
        r"^\s*(\d\.\d{3})\s+(-?\d+\.\d{3})\s+(['\"].*['\"])$", text, flags=re.MULTILINE
    )
    assert len(samples) == 16, text
    for _, log_weight, sample in samples:
        assert IN_LANGUAGE.match(ast.literal_eval(sample)), sample
        assert float(log_weight) <= 1e-3
    assert sum(float(w) for w, _, _ in samples) == pytest.approx(1.0, abs=0.01)
    # Per step: the mean removed mass is in [0, 1] and the log allowed masses are <= 0.
    steps = re.findall(
        r"^\s*(\d+)\s+(\d+)\s+(-?\d\.\d{4})\s+(-?\d+\.\d{3})\s+(-?\d+\.\d{3})\s+(-?\d+\.\d{3})$",
        text,
        flags=re.MULTILINE,
    )
    assert [int(s[0]) for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 2, text
    for _, num_particles, removed, low, mean, high in steps:
        assert 1 <= int(num_particles) <= 16
        assert -1e-4 <= float(removed) <= 1
        assert float(low) <= float(mean) <= float(high) <= 1e-3
    # The constraint bites at the first step: the prompt's likeliest continuations
    # (" the", " a") are not cities.
    assert float(steps[0][2]) > 0.1
    assert "<Figure size" in text  # the plot was drawn


def table_rows(text: str, prefix: str) -> list[list[str]]:
    """The cells of the printed '|'-separated table rows whose first cell starts with ``prefix``."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) > 1 and cells[0].startswith(prefix):
            rows.append(cells)
    return rows


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def expected_w1(results: Path) -> dict:
    """(file, variant, N) -> (floor_s, time_s, time/floor, N*t(1)/t(N) or None), from the JSON."""
    expected = {}
    for path in sorted(results.glob("w1_*.json")):
        try:
            rows = json.loads(path.read_text())["rows"]
        except (ValueError, KeyError, TypeError):
            continue
        for key, variant, suffix in (
            ("wall_s", "default", ""), ("wall_s_nosess", "sessions off", "_nosess")
        ):
            # The floor of record where the file has it: vLLM's own defaults on a plain engine.
            points = {
                int(r["N"]): (r, "floor_vllm_s" if is_number(r.get("floor_vllm_s")) else "floor_s")
                for r in rows
                if isinstance(r, dict) and all(is_number(r.get(k)) for k in ("N", key))
                and (is_number(r.get("floor_s")) or is_number(r.get("floor_vllm_s")))
            }
            for n, (row, floor) in points.items():
                ratio = row[key] / row[floor]
                stored = ("ratio_vllm" if floor == "floor_vllm_s" else "ratio") + suffix
                if stored in row:  # the benchmark's own ratio is the same quotient
                    assert ratio == pytest.approx(row[stored], rel=1e-9)
                gain = n * points[1][0][key] / row[key] if 1 in points else None
                expected[(path.stem, variant, n)] = (row[floor], row[key], ratio, gain)
    return expected


def check_w1_table(text: str, results: Path) -> None:
    expected = expected_w1(results)
    printed = {(c[0], c[1], int(c[2])): c[3:] for c in table_rows(text, "w1_")}
    assert printed.keys() == expected.keys()
    for key, (floor, time, ratio, gain) in expected.items():
        cells = printed[key]
        assert float(cells[0]) == pytest.approx(floor, abs=5.1e-5), key
        assert float(cells[1]) == pytest.approx(time, abs=5.1e-5), key
        assert float(cells[2]) == pytest.approx(ratio, abs=5.1e-4), key
        assert (
            cells[3] == "-" if gain is None else float(cells[3]) == pytest.approx(gain, abs=5.1e-3)
        ), key


def expected_smc(results: Path) -> dict:
    """(file, workload, N) -> (floor_s, wall_s, wall/floor, ratio_nosample), from the W1/W5 JSON."""
    expected = {}
    for path in sorted(results.glob("smc_*.json")):
        try:
            tables = json.loads(path.read_text())["tables"]
        except (ValueError, KeyError, TypeError):
            continue
        for workload, rows in tables.items():
            for r in rows:
                if all(is_number(r.get(k)) for k in ("N", "floor_s", "wall_s", "ratio_nosample")):
                    if "starts" in r:  # over engine starts: the median of each start's ratio
                        ratio = r["ratio"]
                        assert r["ratio_min"] <= ratio <= r["ratio_max"]
                    else:
                        ratio = r["wall_s"] / r["floor_s"]
                        assert ratio == pytest.approx(r["ratio"], rel=1e-9)  # the file's own
                    expected[(path.stem, workload, int(r["N"]))] = (
                        r["floor_s"], r["wall_s"], ratio, r["ratio_nosample"])
    return expected


def check_smc_table(text: str, results: Path) -> None:
    expected = expected_smc(results)
    printed = {(c[0], c[1], int(c[2])): c[3:] for c in table_rows(text, "smc_")}
    assert printed.keys() == expected.keys() and expected
    for key, (floor, wall, ratio, nosample) in expected.items():
        cells = printed[key]
        assert float(cells[0]) == pytest.approx(floor, abs=5.1e-5), key
        assert float(cells[1]) == pytest.approx(wall, abs=5.1e-5), key
        assert float(cells[2]) == pytest.approx(ratio, abs=5.1e-4), key
        assert float(cells[3]) == pytest.approx(nosample, abs=5.1e-4), key


def test_performance_notebook_prints_the_ratios_of_the_result_files():
    text = run_notebook(NOTEBOOK_DIR / "performance.ipynb")
    check_smc_table(text, RESULTS)
    check_w1_table(text, RESULTS)
    assert "<Figure size" in text  # the plot was drawn
    # W1/W5: the plot shows the figures the README cites (and the CPU run), not every file.
    assert "plotted: smc_vllm_cpu, smc_vllm_h200, smc_vllm_h200_earlier\n" in text
    # W3: B times the B=1 median over the B-row median, for every method measured at B=1.
    expected = {}
    for path in sorted(RESULTS.glob("w3_*.json")):
        medians = {}
        for row in json.loads(path.read_text()).get("rows", []):
            match = re.fullmatch(r"(.+) B=(\d+)", str(row.get("workload", "")))
            if match and is_number(row.get("median_ms")):
                key = (str(row.get("vocab")), match.group(1), int(match.group(2)))
                medians[key] = row["median_ms"]
        for (vocab, method, size), t in medians.items():
            if size > 1 and (vocab, method, 1) in medians:
                expected[(path.stem, vocab, method, size)] = size * medians[(vocab, method, 1)] / t
    printed = {(c[0], c[1], c[2], int(c[3])): float(c[6]) for c in table_rows(text, "w3_")}
    assert printed.keys() == expected.keys() and expected
    for key, gain in expected.items():
        assert printed[key] == pytest.approx(gain, abs=5.1e-3), key
    # W4: the per-token loop's median over decode_vocab's, which is the file's own "speedup".
    rows = json.loads((RESULTS / "w4_decode_vocab.json").read_text())["rows"]
    printed = {c[1]: float(c[4]) for c in table_rows(text, "w4_")}
    ours = {r["vocabulary"]: r for r in rows if r["method"] == "decode_vocab"}
    baseline = {r["vocabulary"]: r["median_s"] for r in rows if r["method"] == "per-token baseline"}
    assert printed.keys() == ours.keys() == baseline.keys()
    for vocabulary, row in ours.items():
        assert baseline[vocabulary] / row["median_s"] == pytest.approx(row["speedup"], rel=1e-9)
        assert printed[vocabulary] == pytest.approx(row["speedup"], abs=5.1e-3)


def test_performance_notebook_skips_missing_files_and_ignores_additions(tmp_path, monkeypatch):
    # Only the CPU results, each with fields a later runner might add; no GPU files; plus
    # new files of other shapes, one of them unreadable.
    for name in ("smc_vllm_cpu", "w1_hf_cpu", "w3_trie_cpu", "w4_decode_vocab"):
        data = json.loads((RESULTS / f"{name}.json").read_text())
        data["suite"] = {"run_id": 7}
        for rows in data["tables"].values() if "tables" in data else [data["rows"]]:
            for row in rows:
                row["added_field"] = "x"
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    (tmp_path / "w1_new_workload.json").write_text(
        json.dumps({"rows": [{"N": 4, "latency_s": 1.0}]})
    )
    (tmp_path / "w1_truncated.json").write_text('{"rows": [')
    (tmp_path / "suite_summary.json").write_text("[]")
    monkeypatch.setenv("GENLM_BENCHMARK_RESULTS", str(tmp_path))
    text = run_notebook(NOTEBOOK_DIR / "performance.ipynb")
    for missing in ("smc_vllm_h200", "w1_hf_h100_batched", "w3_trie_h100", "heartbeat_hf"):
        assert f"note: {missing}.json is missing; skipped" in text
    assert "plotted: smc_vllm_cpu\n" in text
    assert "note: w1_truncated.json could not be read" in text
    assert "note: w1_new_workload.json has no rows with N, floor_s and wall_s; skipped" in text
    check_smc_table(text, tmp_path)
    assert {c[0] for c in table_rows(text, "smc_")} == {"smc_vllm_cpu"}
    check_w1_table(text, tmp_path)
    assert {c[0] for c in table_rows(text, "w1_")} == {"w1_hf_cpu"}
    assert {c[0] for c in table_rows(text, "w3_")} == {"w3_trie_cpu"}
    assert len(table_rows(text, "w4_")) == 2
