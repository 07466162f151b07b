#!/usr/bin/env bash
# `make test`: lint, type-check and the whole suite, in two lanes run side by side:
#
#   fleet  tests/integration: real vLLM replicas, the docs walk
#   rest   everything else: the router against fakes, fine-tuning, deploy logic, ...
#
# and the type check beside them. Each lane is one pytest session (the fleet lane
# starts its shared replicas once); on this 2-core machine the lanes together take
# about as long as the longer one alone. The fleet lane prints as it goes; the rest
# lane's output follows it. The exit status is the first failure's (lint, types,
# fleet, rest). DPSERVE_TEST_LANES=1 runs the lanes one after the other instead.
#
#   scripts/test.sh BIN_DIR [PYTEST_ARGS...]   (DPSERVE_TEST_MODEL set by make)
set -uo pipefail

bin="$1"
shift
lanes="${DPSERVE_TEST_LANES:-2}"
case "$lanes" in
    1|2) ;;
    *) echo "test: DPSERVE_TEST_LANES must be 1 or 2, got '$lanes'" >&2; exit 2 ;;
esac

"$bin/ruff" check . || exit 1

scratch="$(mktemp -d -t dpserve-test.XXXXXX)"
# Job control: each job below is its own process group, SIGINT not ignored (bash
# ignores it in background jobs otherwise), so a ctrl+c or a SIGTERM reaches every
# pytest as SIGINT and each tears its fixtures down: no replica is left behind.
set -m
pids=()
stop() {
    trap - INT TERM
    for pid in "${pids[@]}"; do
        kill -INT -- "-$pid" 2>/dev/null
    done
    wait
    rm -rf "$scratch"
    exit 130
}
trap stop INT TERM

# Each lane in its own temporary directory: one pytest session must not clean up
# the other's.
lane() {
    local name="$1"
    shift
    "$bin/pytest" --basetemp "$scratch/$name" "$@"
}

if [[ "$lanes" == 1 ]]; then
    "$bin/mypy" & pids=($!); wait "${pids[0]}"; types=$?
    lane fleet tests/integration "$@" & pids=($!); wait "${pids[0]}"; fleet=$?
    lane rest --ignore=tests/integration "$@" & pids=($!); wait "${pids[0]}"; rest=$?
else
    "$bin/mypy" >"$scratch/mypy.txt" 2>&1 &
    pids+=($!)
    lane rest --ignore=tests/integration "$@" >"$scratch/rest.txt" 2>&1 &
    pids+=($!)
    lane fleet tests/integration "$@" &
    pids+=($!)
    wait "${pids[2]}"; fleet=$?
    wait "${pids[1]}"; rest=$?
    wait "${pids[0]}"; types=$?
    echo
    echo "===== the rest lane (everything but tests/integration) ====="
    cat "$scratch/rest.txt"
    echo "===== mypy ====="
    cat "$scratch/mypy.txt"
fi
rm -rf "$scratch"
echo "test: mypy exit $types, fleet lane exit $fleet, rest lane exit $rest"
for code in "$types" "$fleet" "$rest"; do
    if [[ "$code" != 0 ]]; then
        exit "$code"
    fi
done
