"""Fixtures of the vLLM tests (tiny offline models, session-scoped engines): see vllm_fixtures;
and an empty temporary directory for the tests of engine processes."""

import tempfile

import pytest
from vllm_fixtures import hf_reference, tiny_model_dirs, vllm_lm, vlm  # noqa: F401


@pytest.fixture
def fresh_tmp(tmp_path, monkeypatch):
    """An empty temporary directory that this process and its children use."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
