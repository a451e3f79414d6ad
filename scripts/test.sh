#!/usr/bin/env bash
# Sets up the environment (scripts/setup_env.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. scripts/test.sh -k torch -x
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pytest "$@"
