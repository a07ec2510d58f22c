#!/usr/bin/env bash
# A throwaway PostgreSQL cluster for the test suite, started the way
# tests/src/postgres.rs starts one: Debian's `postgresql` binaries (initdb, pg_ctl,
# found on PATH or under /usr/lib/postgresql/<version>/bin), a superuser `gradflow`
# trusted on loopback, fsync off (the database's own crash safety is not what the
# tests test).
#
#   scripts/test-postgres.sh start DIR   # initdb in DIR, start on a free loopback
#                                        # port, print postgres://gradflow@127.0.0.1:PORT
#   scripts/test-postgres.sh stop DIR    # stop it and remove DIR
#
# initdb and postgres refuse to run as root: as root they run as the `postgres` user
# the package creates (runuser), and DIR is given to it. A start that fails half-way
# stops what it started and removes DIR. Exit code 3: PostgreSQL is not installed.
set -euo pipefail

usage() {
    echo "usage: $0 start|stop DIR" >&2
    exit 2
}
[ $# -eq 2 ] || usage
command=$1
dir=$2

# The directory of initdb and pg_ctl: PATH first, then Debian's newest version.
postgres_bin() {
    if command -v initdb >/dev/null 2>&1 && command -v pg_ctl >/dev/null 2>&1; then
        dirname "$(command -v initdb)"
        return
    fi
    local candidate
    candidate=$(find /usr/lib/postgresql -mindepth 3 -maxdepth 3 -path '*/bin/initdb' 2>/dev/null |
        sort -V | tail -n 1)
    [ -n "$candidate" ] || return 1
    dirname "$candidate"
}

# Runs a PostgreSQL program, as the postgres user when this is root.
as_owner() {
    if [ "$(id -u)" = 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

case $command in
start)
    if ! bin=$(postgres_bin); then
        echo "PostgreSQL is not installed: no initdb on PATH or under /usr/lib/postgresql/*/bin" \
            "(Debian: apt-get install postgresql)" >&2
        exit 3
    fi
    mkdir -p "$dir"
    started=false
    # A start that fails leaves nothing behind.
    cleanup_failed_start() {
        local status=$?
        [ "$status" -eq 0 ] && return
        if [ "$started" = true ]; then
            as_owner "$bin/pg_ctl" stop -w -m immediate -D "$dir/data" >/dev/null 2>&1 || true
        fi
        rm -rf "$dir"
    }
    trap cleanup_failed_start EXIT
    if [ "$(id -u)" = 0 ]; then
        chown postgres:postgres "$dir"
    fi
    as_owner "$bin/initdb" -D "$dir/data" -U gradflow -A trust --no-sync -E UTF8 --locale=C \
        >"$dir/initdb.log" 2>&1 || {
        cat "$dir/initdb.log" >&2
        exit 1
    }
    port=$(free_port)
    started=true
    # max_connections: the server tests run in parallel, each server with a pool of
    # up to 16 connections, and the replica tests start two servers at once.
    as_owner "$bin/pg_ctl" start -w -t 60 -D "$dir/data" -l "$dir/postgres.log" \
        -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off -c full_page_writes=off" \
        >/dev/null || {
        cat "$dir/postgres.log" >&2
        exit 1
    }
    echo "$bin" >"$dir/bin"
    echo "postgres://gradflow@127.0.0.1:$port"
    ;;
stop)
    if [ -f "$dir/bin" ] && [ -d "$dir/data" ]; then
        as_owner "$(cat "$dir/bin")/pg_ctl" stop -w -m fast -D "$dir/data" >/dev/null || true
    fi
    rm -rf "$dir"
    ;;
*)
    usage
    ;;
esac
