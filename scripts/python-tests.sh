#!/usr/bin/env bash
# The Python client's checks: a virtual environment with torch and transformers from
# PyPI (reused between runs), the client installed into it, the server binary the
# tests start, ruff, then pytest against the real server.
#
#   GRADFLOW_VENV        the virtual environment (default ~/.cache/gradflow/venv)
#   GRADFLOW_SERVER_BIN  a server binary to test against instead of building one
#   extra arguments      passed to pytest (e.g. -k outage)
set -euo pipefail
cd "$(dirname "$0")/.."

venv="${GRADFLOW_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/gradflow/venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --quiet --disable-pip-version-check)

# torch's default PyPI wheel; installed only when missing, so the cached venv is reused.
"$py" -c "import torch" 2>/dev/null || "${pip[@]}" torch
"$py" -c "import transformers" 2>/dev/null || "${pip[@]}" transformers
# The Hugging Face Trainer needs accelerate.
"$py" -c "import accelerate" 2>/dev/null || "${pip[@]}" accelerate
"$py" -c "import pytest" 2>/dev/null || "${pip[@]}" pytest
"$py" -c "import ruff" 2>/dev/null || [ -x "$venv/bin/ruff" ] || "${pip[@]}" ruff
"${pip[@]}" --no-deps -e ./clients/python
# The package builds as a wheel (pure Python, standard library only).
rm -rf "${TMPDIR:-/tmp}/gradflow-wheel"
"$py" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation \
    -w "${TMPDIR:-/tmp}/gradflow-wheel" ./clients/python

if [ -z "${GRADFLOW_SERVER_BIN:-}" ]; then
    cargo build --quiet -p gradflow-server
fi

"$venv/bin/ruff" format --check clients/python
"$venv/bin/ruff" check clients/python

# pytest's exit code 5 ("no tests collected") is a failure here too: `set -e` fails
# on any non-zero status.
cd clients/python
"$py" -m pytest tests -q -p no:cacheprovider "$@"
