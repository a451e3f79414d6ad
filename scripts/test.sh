#!/usr/bin/env bash
# Sets up the environment (scripts/setup_env.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k torch -x
# The test files run on one pytest-xdist worker per core (at most 4; COMMSCHED_TEST_JOBS sets the
# number, 1 runs them in this process, as -s and --pdb need). A file stays on one worker, so its
# module fixtures are built once: most tests wait on ranks they launched, and a second worker fills
# the cores while one waits.
set -euo pipefail
cd "$(dirname "$0")/.."
cores="$(nproc)"
jobs="${COMMSCHED_TEST_JOBS-$((cores < 4 ? cores : 4))}"
case "$jobs" in
  '' | *[!0-9]* | 0)
    echo "scripts/test.sh: COMMSCHED_TEST_JOBS=$jobs: give a whole number, 1 or more (1 runs the tests in one process)" >&2
    exit 2
    ;;
esac
# COMMSCHED_TEST_FULL=1 also runs the cells marked `full` (tests/conftest.py), which CI's run leaves out.
# COMMSCHED_TEST_CPU_LOG=FILE: each test appends its wall and CPU time to FILE (tests/conftest.py).
case "${COMMSCHED_TEST_FULL-}" in
  '' | 0 | 1) ;;
  *)
    echo "scripts/test.sh: COMMSCHED_TEST_FULL=$COMMSCHED_TEST_FULL: give 1 (every matrix cell) or leave it unset" >&2
    exit 2
    ;;
esac
scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
if [ "$jobs" -gt 1 ]; then
  exec python -m pytest -n "$jobs" --dist loadfile "$@"
fi
exec python -m pytest "$@"
