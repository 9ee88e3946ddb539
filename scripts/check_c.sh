#!/usr/bin/env bash
# The C extensions' tests under AddressSanitizer.
#
# Builds every C extension of the package (each genlm_backend/**/*.c) with
# -fsanitize=address -g -O1 into a scratch copy of the package and the tests, then runs the
# C tests there with libasan preloaded and Python's allocator switched to malloc (pymalloc
# would hide freed objects from ASan). The normal build (the *.so beside the sources) is not
# touched. Leak detection is off (CPython keeps memory until exit); the tests count live
# objects for that. Exits non-zero on a failed test or on any ASan report, in this process or
# in any process it starts. Uses ./.venv (scripts/install.sh) where it exists; takes about a
# minute. Debian: needs gcc (installed here if missing) and its libasan.
#
#   bash scripts/check_c.sh                 # the C tests
#   bash scripts/check_c.sh tests/trie/...  # other tests, or pytest options, instead
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
    tests=(tests/trie/test_trie_kernel.py tests/trie/test_trie_kernel_lifetimes.py)
fi

if ! command -v gcc >/dev/null; then
    apt-get update -qq && apt-get install -y -qq gcc >/dev/null
fi
libasan=$(gcc -print-file-name=libasan.so)
if [ ! -e "$libasan" ]; then  # gcc without its sanitizer runtime (Debian: libasanN)
    apt-get update -qq && apt-get install -y -qq "$(apt-cache search --names-only '^libasan[0-9]+$' | sort -V | tail -1 | cut -d' ' -f1)" >/dev/null
    libasan=$(gcc -print-file-name=libasan.so)
fi
[ -e "$libasan" ] || { echo "check_c: no libasan.so for $(gcc --version | head -1)" >&2; exit 2; }

scratch=$(mktemp -d "${TMPDIR:-/tmp}/check_c.XXXXXX")
finish() {
    local status=$?
    if compgen -G "$scratch/asan/report*" >/dev/null; then
        cat "$scratch"/asan/report* >&2
        echo "check_c: AddressSanitizer reported the errors above" >&2
        status=1
    elif [ "$status" -ne 0 ]; then
        echo "check_c: failed (exit status $status)" >&2
    fi
    rm -rf "$scratch"
    exit "$status"
}
trap finish EXIT
copied=(genlm_backend tests pyproject.toml)
[ -d benchmarks ] && copied+=(benchmarks)  # some tests run a benchmark script
tar -c --exclude='*.so' --exclude='*.pyd' --exclude=__pycache__ "${copied[@]}" | tar -x -C "$scratch"
mkdir "$scratch/asan"

include=$(python -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
suffix=$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
built=()
while IFS= read -r source; do
    target="$scratch/${source%.c}$suffix"
    gcc -shared -fPIC -pthread -fsanitize=address -fno-omit-frame-pointer -g -O1 -Wall \
        -I"$include" "$source" -o "$target"
    built+=("${source%.c}")
done < <(find genlm_backend -name '*.c' | sort)
echo "check_c: built with ASan: ${built[*]}"

cd "$scratch"
export LD_PRELOAD="$libasan${LD_PRELOAD:+:$LD_PRELOAD}"
export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$scratch/asan/report"
export PYTHONMALLOC=malloc PYTHONDONTWRITEBYTECODE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export GENLM_REQUIRE_TRIE_KERNEL=1  # just built: its tests must not skip
# The scratch copy, not the editable install, must be what the tests import.
python - "$scratch" "${built[@]}" <<'EOF'
import importlib, sys
scratch, *modules = sys.argv[1:]
for path in modules:
    module = importlib.import_module(path.replace("/", "."))
    assert module.__file__.startswith(scratch + "/"), f"{module.__name__} came from {module.__file__}"
EOF
python -m pytest -q -p no:cacheprovider --rootdir="$scratch" "${tests[@]}"
