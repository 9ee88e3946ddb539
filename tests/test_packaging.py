"""An editable install (``pip install -e .``, which scripts/install.sh runs on every call)
prints no warning: pip 25 and newer show the build backend's warnings to the user."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _major(distribution: str) -> int:
    """The major version of an installed distribution (not imported: setuptools replaces
    distutils when imported), or 0 where it is not installed."""
    try:
        return int(importlib.metadata.version(distribution).split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return 0


def _pip_has(distribution: str) -> bool:
    """Whether pip sees ``distribution`` installed in this environment."""
    shown = subprocess.run([sys.executable, "-m", "pip", "show", "-q", distribution],
                           capture_output=True, timeout=120, check=False)
    return shown.returncode == 0


def test_an_editable_install_prints_no_warning(tmp_path):
    if _major("pip") < 25 or _major("setuptools") < 77:
        pytest.skip("pip >= 25 (shows backend warnings) and setuptools >= 77 (pyproject.toml)")
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(REPO / "genlm_backend", project / "genlm_backend",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    # Into a folder of its own, with this environment's setuptools: offline, and this
    # environment's own installation is left as it is (without --ignore-installed, pip
    # uninstalls it first).
    installed_before = _pip_has("genlm-backend")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "install", "-q", "--no-deps",
         "--no-build-isolation", "--no-index", "--ignore-installed", "-e", str(project),
         "--prefix", str(tmp_path / "prefix")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "Warning" not in output, output[-4000:]
    assert _pip_has("genlm-backend") == installed_before
