#!/usr/bin/env bash
# The Python client's checks: a virtual environment with torch, transformers and
# lightning from PyPI (reused between runs), the client installed into it (editable),
# the server binary the tests start, ruff, then pytest against the real server.
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
# No pip cache: torch and its CUDA libraries would be kept twice (several GB), once
# installed and once as downloaded wheels that nothing here reads again.
pip=("$py" -m pip install --quiet --disable-pip-version-check --no-cache-dir)

# torch's default PyPI wheel; installed only when missing, so the cached venv is reused.
"$py" -c "import torch" 2>/dev/null || "${pip[@]}" torch
"$py" -c "import transformers" 2>/dev/null || "${pip[@]}" transformers
# The Hugging Face Trainer needs accelerate.
"$py" -c "import accelerate" 2>/dev/null || "${pip[@]}" accelerate
# The PyTorch Lightning callback's tests drive a real lightning Trainer.
"$py" -c "import lightning" 2>/dev/null || "${pip[@]}" lightning
"$py" -c "import pytest" 2>/dev/null || "${pip[@]}" pytest
"$py" -c "import ruff" 2>/dev/null || [ -x "$venv/bin/ruff" ] || "${pip[@]}" ruff
"$py" -c "import mypy" 2>/dev/null || "${pip[@]}" mypy
# DeepSpeed, for the ZeRO tests (tests/test_deepspeed.py): its dependencies, then
# DeepSpeed itself without building its ops (DS_BUILD_OPS=0; its CPU accelerator
# builds the one it needs with ninja at first use) and without build isolation (its
# setup imports the torch installed here). The version gradflow.zero was checked with.
if ! "$py" -c "import deepspeed" 2>/dev/null; then
    "${pip[@]}" wheel setuptools einops hjson msgpack ninja packaging psutil py-cpuinfo \
        "pydantic>=2" tqdm
    DS_BUILD_OPS=0 "${pip[@]}" --no-build-isolation --no-deps "deepspeed==0.19.8"
fi
# The package's build backend (clients/python/hatch_build.py runs inside it), kept in
# the environment so that installs need no build isolation.
"$py" -c "import hatchling" 2>/dev/null || "${pip[@]}" "hatchling>=1.24"
# Editable: src/ on the path, no server binary built into it; the tests start the
# workspace's debug server (GRADFLOW_SERVER_BIN or target/debug/gradflow-server).
# scripts/wheel-smoke.sh builds and checks the wheel, server and all.
"${pip[@]}" --no-deps --no-build-isolation -e ./clients/python

if [ -z "${GRADFLOW_SERVER_BIN:-}" ]; then
    cargo build --quiet -p gradflow-server
fi

"$venv/bin/ruff" format --check clients/python
"$venv/bin/ruff" check clients/python
# The package's type check (settings in clients/python/mypy.ini).
(cd clients/python && "$py" -m mypy)

# pytest's exit code 5 ("no tests collected") is a failure here too: `set -e` fails
# on any non-zero status.
cd clients/python
"$py" -m pytest tests -q -p no:cacheprovider "$@"
