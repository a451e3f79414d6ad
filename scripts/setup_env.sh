#!/usr/bin/env bash
# Creates .venv beside the repository with everything commsched, its tests and its
# benchmarks need, then builds commsched into it (editable). Safe to run again: the pip
# installs and the C++ build are skipped while their inputs are unchanged (stamp files
# under .venv hold a hash of them), so a re-run takes seconds. One line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
torch_pin="torch==2.13.0"
step() { printf 'setup_env: %s\n' "$*"; }

# A hash of the named files' contents (and of every file under the named folders).
inputs_hash() {
  find "$@" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' -print0 2> /dev/null \
    | sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

if [ -x .venv/bin/python ]; then
  step ".venv exists ($(.venv/bin/python --version))"
else
  step "creating .venv with $("$python" --version)"
  "$python" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

deps_stamp=.venv/commsched-deps.stamp
deps_hash="$(
  {
    echo "$torch_pin"
    python --version
    inputs_hash requirements-dev.txt pyproject.toml
  } | sha256sum | cut -d' ' -f1
)"
if [ -f "$deps_stamp" ] && [ "$(cat "$deps_stamp")" = "$deps_hash" ]; then
  step "pip packages up to date (requirements-dev.txt and pyproject.toml unchanged)"
else
  step "installing pip, the CPU build of $torch_pin, then requirements-dev.txt (several minutes the first time)"
  pip install -q --upgrade pip
  # The CPU build of torch first, so nothing later pulls a multi-GB CUDA build for a `torch>=` range.
  pip install -q "$torch_pin"
  pip install -q -r requirements-dev.txt
  echo "$deps_hash" > "$deps_stamp"
fi

# The build's inputs: its scripts, the C++ sources and headers, and the torch it builds against.
build_stamp=.venv/commsched-build.stamp
build_hash="$(
  {
    python --version
    ls -d .venv/lib/python*/site-packages/torch-*.dist-info 2> /dev/null || true
    inputs_hash setup.py pyproject.toml requirements-dev.txt csrc commsched/include plugins/tensorflow/ops
  } | sha256sum | cut -d' ' -f1
)"
# The stamp also lists the extension modules the build made: one missing means rebuilding.
built_ok() {
  [ -f "$build_stamp" ] && [ "$(head -n 1 "$build_stamp")" = "$build_hash" ] || return 1
  ls .venv/lib/python*/site-packages/__editable__.commsched-*.pth > /dev/null 2>&1 || return 1
  local module
  while read -r module; do
    [ -f "commsched/$module" ] || return 1
  done < <(tail -n +2 "$build_stamp")
}
if built_ok; then
  step "commsched's C++ extensions up to date (sources unchanged since the last build)"
else
  step "building commsched's C++ extensions (about 1.5 minutes on 2 CPUs; log in .venv/build.log)"
  rm -f "$build_stamp"
  # The build's own chatter goes to a log; it is shown only when the build fails.
  if ! pip install -q -e . --no-build-isolation > .venv/build.log 2>&1; then
    cat .venv/build.log
    exit 1
  fi
  {
    echo "$build_hash"
    (cd commsched && ls _*.so)
  } > "$build_stamp"
fi
step "$(python -c "import commsched, commsched._mpi; print('commsched', commsched.__version__, 'built with MPI')")"
