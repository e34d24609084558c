# Start a throw-away PostgreSQL server for the tuner's shared-storage test.
#
# Sourced by .ci/run (`source .ci/postgres.sh`); it exports HF_SELFSPEC_TEST_POSTGRES_URL, which
# tests/tuning/test_tuning_postgres.py reads (and, under CI, insists on). It installs Debian's
# `postgresql` when it is missing, initialises a cluster in a temporary directory as the
# `postgres` user (initdb refuses root), listens on 127.0.0.1 only, on a free port, and stops the
# server when the sourcing shell exits. Sourcing it twice reuses a server that still answers.
# It leaves the caller's shell options alone and returns non-zero, with a message, on failure.
# The Python driver, psycopg2-binary, comes with the `tuning` extra.

hf_selfspec_stop_postgres() {
    if [ -n "${HF_SELFSPEC_PGROOT:-}" ] && [ -d "$HF_SELFSPEC_PGROOT" ]; then
        hf_selfspec_pg_run "$HF_SELFSPEC_PGBIN/pg_ctl" -D "$HF_SELFSPEC_PGROOT/data" -m fast -w stop >/dev/null 2>&1
        rm -rf "$HF_SELFSPEC_PGROOT"
    fi
    unset HF_SELFSPEC_PGROOT HF_SELFSPEC_TEST_POSTGRES_URL
}

# Run a server command as the cluster's owner: `postgres` when we are root, else ourselves.
hf_selfspec_pg_run() {
    if [ "$(id -u)" -eq 0 ]; then
        runuser -u postgres -- "$@"
    else
        "$@"
    fi
}

hf_selfspec_start_postgres() {
    if [ -n "${HF_SELFSPEC_TEST_POSTGRES_URL:-}" ] && [ -n "${HF_SELFSPEC_PGBIN:-}" ] \
        && "$HF_SELFSPEC_PGBIN/pg_isready" -q -h 127.0.0.1 -p "${HF_SELFSPEC_PGPORT:-0}"; then
        echo "postgres.sh: reusing the server on 127.0.0.1:$HF_SELFSPEC_PGPORT"
        return 0
    fi

    if ! ls -d /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
        echo "postgres.sh: installing postgresql from Debian's packages"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null \
            || { echo "postgres.sh: apt-get install postgresql failed" >&2; return 1; }
    fi
    HF_SELFSPEC_PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)

    HF_SELFSPEC_PGROOT=$(mktemp -d /tmp/hf-selfspec-pg.XXXXXX) || return 1
    export HF_SELFSPEC_PGROOT HF_SELFSPEC_PGBIN
    if [ "$(id -u)" -eq 0 ]; then
        chown postgres: "$HF_SELFSPEC_PGROOT"
    fi
    HF_SELFSPEC_PGPORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    export HF_SELFSPEC_PGPORT

    # Trust authentication is safe here: the server only listens on 127.0.0.1 and a socket
    # inside its own data directory, and lives as long as this shell.
    hf_selfspec_pg_run "$HF_SELFSPEC_PGBIN/initdb" -D "$HF_SELFSPEC_PGROOT/data" -U postgres -A trust \
        --no-sync >"$HF_SELFSPEC_PGROOT/initdb.log" 2>&1 \
        || { echo "postgres.sh: initdb failed:" >&2; cat "$HF_SELFSPEC_PGROOT/initdb.log" >&2; return 1; }
    hf_selfspec_pg_run "$HF_SELFSPEC_PGBIN/pg_ctl" -D "$HF_SELFSPEC_PGROOT/data" -w -t 60 \
        -l "$HF_SELFSPEC_PGROOT/server.log" \
        -o "-p $HF_SELFSPEC_PGPORT -c listen_addresses=127.0.0.1 -k $HF_SELFSPEC_PGROOT -c fsync=off" start >/dev/null \
        || { echo "postgres.sh: the server did not start:" >&2; cat "$HF_SELFSPEC_PGROOT/server.log" >&2; return 1; }
    "$HF_SELFSPEC_PGBIN/createdb" -h 127.0.0.1 -p "$HF_SELFSPEC_PGPORT" -U postgres hf_selfspec_test \
        || { echo "postgres.sh: createdb failed" >&2; return 1; }

    export HF_SELFSPEC_TEST_POSTGRES_URL="postgresql+psycopg2://postgres@127.0.0.1:$HF_SELFSPEC_PGPORT/hf_selfspec_test"
    echo "postgres.sh: PostgreSQL $("$HF_SELFSPEC_PGBIN/postgres" --version | awk '{print $3}') on 127.0.0.1:$HF_SELFSPEC_PGPORT"

    # Stop the server when the sourcing shell exits, keeping any EXIT trap it already had.
    local previous
    previous=$(trap -p EXIT)
    if [ -n "$previous" ]; then
        eval "previous=(${previous})"
        trap "hf_selfspec_stop_postgres; ${previous[2]}" EXIT
    else
        trap hf_selfspec_stop_postgres EXIT
    fi
}

hf_selfspec_start_postgres
