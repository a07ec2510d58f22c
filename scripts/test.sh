#!/usr/bin/env bash
# Every test: the Rust workspace (unit, server and end-to-end tests of the real
# binaries, on SQLite), the PostgreSQL suite (the server tests again on PostgreSQL,
# and the end-to-end tests of two replicas sharing one database), then the Python
# client's suite against the real server. Arguments go to cargo nextest.
#
# The PostgreSQL suite runs on one throwaway cluster (scripts/test-postgres.sh), or
# on the server GRADFLOW_TEST_POSTGRES_URL names. Without PostgreSQL installed it is
# skipped, saying so, unless GRADFLOW_REQUIRE_POSTGRES=1 (CI), which makes that a
# failure.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo nextest run --workspace "$@"

postgres_dir=""
stop_postgres() {
    if [ -n "$postgres_dir" ]; then
        bash scripts/test-postgres.sh stop "$postgres_dir"
    fi
}
trap stop_postgres EXIT

postgres_url=${GRADFLOW_TEST_POSTGRES_URL:-}
if [ -z "$postgres_url" ]; then
    postgres_dir=$(mktemp -d "${TMPDIR:-/tmp}/gradflow-pg.XXXXXX")
    status=0
    postgres_url=$(bash scripts/test-postgres.sh start "$postgres_dir") || status=$?
    if [ $status -ne 0 ]; then
        rm -rf "$postgres_dir"
        postgres_dir=""
        if [ $status -eq 3 ] && [ "${GRADFLOW_REQUIRE_POSTGRES:-}" != 1 ]; then
            echo "=== PostgreSQL suite SKIPPED: PostgreSQL is not installed (apt-get install" \
                "postgresql, or set GRADFLOW_TEST_POSTGRES_URL) ===" >&2
        else
            echo "error: the PostgreSQL suite cannot run: no PostgreSQL cluster could be started" \
                "(GRADFLOW_REQUIRE_POSTGRES=1 makes this a failure)" >&2
            exit 1
        fi
    fi
fi
if [ -n "$postgres_url" ]; then
    if [ -n "$postgres_dir" ]; then
        echo "=== PostgreSQL suite on a throwaway cluster: $postgres_url ===" >&2
    else
        echo "=== PostgreSQL suite on GRADFLOW_TEST_POSTGRES_URL ===" >&2
    fi
    export GRADFLOW_TEST_POSTGRES_URL=$postgres_url
    # A filter among the arguments may leave one of the two runs with no test.
    # Both select with a filterset over the whole workspace, not with `-p`: cargo
    # resolves dependency features for the packages it is asked to build, so `-p`
    # would compile a second copy of most dependencies (minutes, and gigabytes of
    # target/), where the workspace's test build above already has every binary.
    GRADFLOW_TEST_BACKEND=postgres cargo nextest run --workspace \
        -E "package(=gradflow-server)" --no-tests=warn "$@"
    cargo nextest run --workspace -E "package(=gradflow-e2e) & binary(=e2e) & test(/^replicas::/)" \
        --no-tests=warn "$@"
    stop_postgres
    postgres_dir=""
fi

bash scripts/python-tests.sh
