#!/usr/bin/env bash
# Installs everything the tests need into ./.venv, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
. .venv/bin/activate
# One thread per op keeps the 2-core machine's timings stable and vLLM-CPU predictable.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export GENLM_REQUIRE_TRIE_KERNEL=1  # tests fail if the optional C kernel did not build
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
