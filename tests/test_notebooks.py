"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and says what it should."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def run_notebook(path: Path) -> str:
    """Executes ``path`` in its own folder and returns all of its text output."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            texts.append(output.get("text", ""))
            texts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(texts)


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["quickstart.ipynb"]


def test_quickstart_runs_and_its_rows_are_normalised_and_repeatable():
    text = run_notebook(NOTEBOOKS[0])
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
    weights = [float(w) for w in re.findall(r"^\s*(\d\.\d{3})  '", text, flags=re.M)]
    assert len(weights) == 8 and sum(weights) == pytest.approx(1.0, abs=0.01)
