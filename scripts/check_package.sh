#!/usr/bin/env bash
# Packaging check (CI): build the sdist and the wheel (the wheel from the sdist, as pip would),
# `twine check --strict` them, install the wheel into a fresh venv and use it from outside the
# checkout: import it, load the server's static page and the split-certified roster (package data),
# and run `skippy-llama --help`.
#
# llama-cpp-python is installed first from the wheel scripts/setup.sh built (PyPI has only its
# sdist, a 5-minute compile); every other dependency comes from the registry as for any user.
# Environment: SKIPPY_VENV, the venv with build and twine (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SKIPPY_VENV:-.venv}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if ! "$VENV/bin/python" -m build --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1; then
  cat "$WORK/build.log" >&2
  echo "check_package: python -m build failed" >&2
  exit 1
fi
"$VENV/bin/twine" check --strict "$WORK"/dist/*
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install --quiet --upgrade pip
LLAMA_WHEEL="$(cat "$VENV/.skippy-llama-wheel")"
"$WORK/venv/bin/python" -m pip install --quiet --no-deps "$LLAMA_WHEEL"
WHEEL="$(ls "$WORK"/dist/skippy_llama-*.whl)"
# with the server extra, as `pip install 'skippy-llama[server]'` (serve, its status page)
"$WORK/venv/bin/python" -m pip install --quiet "$WHEEL[server]"
cd "$WORK"
venv/bin/python - << 'PY'
from importlib import resources
from pathlib import Path

import skippy_llama
from skippy_llama import SkippyLlama, roster
from skippy_llama.cli.main import main  # noqa: F401  (the console script's target)

where = Path(skippy_llama.__file__).resolve()
assert "site-packages" in where.parts, f"imported the checkout, not the wheel: {where}"
static = resources.files("skippy_llama.server") / "static"
for name in ("index.html", "status.css", "status.js"):
    assert (static / name).is_file(), f"the wheel lacks skippy_llama/server/static/{name}"
loaded = roster.load_roster()
assert loaded is not None, f"the wheel lacks the split-certified roster ({roster.ROSTER_PATH})"
print(f"check_package: {SkippyLlama.__name__} from {where.parent}; roster {roster.ROSTER_PATH}")
PY
venv/bin/skippy-llama --help > /dev/null
echo "check_package: sdist and wheel built, twine check passed, the wheel installs and runs"
