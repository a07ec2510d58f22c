#!/usr/bin/env bash
# Every test: the Rust workspace (unit, server and end-to-end tests of the real
# binaries), then the Python client's suite against the real server. Arguments go
# to cargo nextest.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo nextest run --workspace "$@"
bash scripts/python-tests.sh
