#!/usr/bin/env bash
# Creates .venv beside the repository with everything commsched, its tests and its
# benchmarks need, then builds commsched into it (editable). torch and requirements-build.txt go
# first; the C++ build then runs in the background while the rest of requirements-dev.txt installs.
# Safe to run again: the pip installs and the C++ build are skipped while their inputs are unchanged
# (stamp files under .venv hold a hash of them), so a re-run takes seconds. One line per step.
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
    inputs_hash requirements-build.txt requirements-dev.txt pyproject.toml
  } | sha256sum | cut -d' ' -f1
)"
deps_ok=0
if [ -f "$deps_stamp" ] && [ "$(cat "$deps_stamp")" = "$deps_hash" ]; then
  deps_ok=1
  step "pip packages up to date (requirements-*.txt and pyproject.toml unchanged)"
else
  step "installing pip, the CPU build of $torch_pin, then requirements-build.txt"
  pip install -q --upgrade pip
  # The CPU build of torch first, so nothing later pulls a multi-GB CUDA build for a `torch>=` range.
  pip install -q "$torch_pin"
  pip install -q -r requirements-build.txt
fi

# The build's inputs: its scripts, the C++ sources and headers, and the torch it builds against.
build_stamp=.venv/commsched-build.stamp
build_hash="$(
  {
    python --version
    ls -d .venv/lib/python*/site-packages/torch-*.dist-info 2> /dev/null || true
    inputs_hash setup.py pyproject.toml requirements-build.txt csrc commsched/include plugins/tensorflow/ops
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
build_pid=""
if built_ok; then
  step "commsched's C++ extensions up to date (sources unchanged since the last build)"
else
  step "building commsched's C++ extensions in the background (about 2 minutes on 2 CPUs; log in .venv/build.log)"
  rm -f "$build_stamp"
  # --no-deps: the build needs only torch and requirements-build.txt, both in place; the build's own
  # chatter goes to a log, shown only when it fails.
  pip install -q --no-deps -e . --no-build-isolation > .venv/build.log 2>&1 &
  build_pid=$!
  # A failed install below ends the script: the build goes with it.
  trap '[ -z "$build_pid" ] || kill "$build_pid" 2> /dev/null || true' EXIT
fi

if [ "$deps_ok" = 0 ]; then
  step "installing the rest of requirements-dev.txt beside the build"
  # The packages the build uses stay as they are while it runs: pinned to their installed versions.
  constraints=.venv/build-constraints.txt
  build_packages="$(sed -E 's/#.*//; s/[<>=!~ ].*//' requirements-build.txt | grep -v '^$' | paste -sd '|')"
  pip freeze --all | grep -iE "^(torch|$build_packages)==" > "$constraints"
  if ! pip install -q -r requirements-dev.txt -c "$constraints"; then
    step "requirements-dev.txt needs other versions of the build's packages: installing after the build"
    [ -z "$build_pid" ] || wait "$build_pid" || true
    pip install -q -r requirements-dev.txt
    step "building again, against the packages installed now"
    rm -f "$build_stamp"
    exec scripts/setup_env.sh
  fi
  echo "$deps_hash" > "$deps_stamp"
fi

if [ -n "$build_pid" ]; then
  build_status=0
  wait "$build_pid" || build_status=$?
  build_pid=""
  if [ "$build_status" != 0 ]; then
    cat .venv/build.log
    exit 1
  fi
  {
    echo "$build_hash"
    (cd commsched && ls _*.so)
  } > "$build_stamp"
fi
step "$(python -c "import commsched, commsched._mpi; print('commsched', commsched.__version__, 'built with MPI')")"
