#!/usr/bin/env bash
# Builds the documentation site (mkdocs.yml, docs/) with warnings as errors.
#   bash scripts/build_docs.sh              # builds into a temporary folder, then removes it
#   bash scripts/build_docs.sh path/to/site # builds into that folder and keeps it
# Installs the docs tools into ./.venv where they are missing (creating ./.venv if needed).
# The API reference is read from the sources (mkdocstrings reads them statically), so the
# build needs neither torch nor vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
# Versions checked together; pymdown-extensions gives the snippets and nested code blocks.
tools=(mkdocs==1.6.1 "mkdocstrings[python]==1.0.8" mkdocstrings-python==2.0.11 pymdown-extensions==13.1.2)
if ! python - "${tools[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, wanted = pin.replace("[python]", "").split("==")
    try:
        if version(name) != wanted:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
  python -m pip --disable-pip-version-check install -q -c constraints-cpu.txt "${tools[@]}"
fi
site=${1:-}
where="in $site"
if [ -z "$site" ]; then
  site=$(mktemp -d)
  trap 'rm -rf "$site"' EXIT
  where="(a check: the site is not kept)"
fi
python -m mkdocs build --strict --site-dir "$site"
echo "docs built: $(find "$site" -name '*.html' | wc -l) HTML pages $where"
