#!/usr/bin/env bash
# Creates .venv beside the repository with everything commsched, its tests and its
# benchmarks need, then builds commsched into it (editable). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip install -q --upgrade pip
# The CPU build of torch first, so nothing later pulls a multi-GB CUDA build for a `torch>=` range.
pip install -q torch==2.13.0
pip install -q -r requirements-dev.txt
# The build's own chatter goes to a log; it is shown only when the build fails.
if ! pip install -q -e . --no-build-isolation > .venv/build.log 2>&1; then
  cat .venv/build.log
  exit 1
fi
python -c "import commsched, commsched._mpi; print('commsched', commsched.__version__, 'built with MPI')"
