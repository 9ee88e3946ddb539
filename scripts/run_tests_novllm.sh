#!/usr/bin/env bash
# CI lane without vLLM: what a Hugging Face-only user installs, and every test that needs no vLLM.
#   bash scripts/run_tests_novllm.sh              # the whole lane
#   bash scripts/run_tests_novllm.sh tests/trie   # pytest arguments narrow it
# Creates ./.cache/venv-novllm (git-ignored) by running README.md's transformers-only install
# lines as written (between its install-transformers markers), checks that no vllm, no CUDA
# build of torch and no nvidia-* package came with them, then adds the test extras. Tests
# marked `vllm` are skipped there by tests/conftest.py (its only reason to skip them is that
# vllm is not importable); tests/test_without_vllm.py runs only there. Idempotent: a second
# run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.cache/venv-novllm
mkdir -p .cache
python3 -m venv "$venv"
. "$venv/bin/activate"
pip="python -m pip --disable-pip-version-check"
$pip install -q --upgrade pip wheel "setuptools>=68"
readme_install=$(python - <<'PY'
import pathlib, re
text = pathlib.Path("README.md").read_text(encoding="utf-8")
block = re.search(r"\[start:install-transformers\] -->\n```bash\n(.*?)\n```\n<!-- --8<-- "
                  r"\[end:install-transformers\]", text, re.DOTALL)
assert block, "README.md has no install-transformers block"
print(block.group(1))
PY
)
echo "README.md's transformers-only install:"
echo "$readme_install"
bash -euo pipefail -c "$readme_install"
check_install() {
  python - <<'PY'
import importlib.util, torch, transformers
assert importlib.util.find_spec("vllm") is None, "vllm is installed in the no-vLLM lane's venv"
assert torch.version.cuda is None, f"a CUDA build of torch was installed: {torch.__version__}"
print(f"no-vLLM lane: torch {torch.__version__}, transformers {transformers.__version__}, no vllm")
PY
  if $pip list --format=freeze | grep -i '^nvidia-'; then
    echo "nvidia-* packages were installed in the no-vLLM lane's venv (above)" >&2
    exit 1
  fi
}
check_install
echo "venv after README.md's install: $(du -sh "$venv" | cut -f1)"
$pip install -q -c constraints-cpu.txt -e ".[dev]"  # the test tools
check_install
python scripts/fetch_test_assets.py
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export GENLM_REQUIRE_TRIE_KERNEL=1  # fail if the optional C kernel did not build
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DO_NOT_TRACK=1
python -m pytest -q -p no:cacheprovider --durations=15 -rfEs "$@"
