#!/usr/bin/env bash
# Installs a wheel from scripts/build_wheels.sh into a fresh venv and, with no C++ compiler on
# PATH, runs commsched-info, a 2-rank MPI allreduce (mpiexec from pip's mpich), a 2-rank torchrun
# Gloo training step and a 2-rank MPI step of the TensorFlow ops (which must come from the wheel,
# not be compiled). Takes minutes (it installs torch and TensorFlow), so CI does not run it.
# usage: scripts/test_wheel.sh [--python PY] [--no-torch] [--no-tf] [WHEEL]
#   WHEEL       default: the newest dist/commsched-*manylinux*.whl for PY
#   --python    the Python the venv is made with (default python3); it must match the wheel's tag
#   --no-torch  skips torch and the Gloo step (torch==2.13.0 is PyPI's CUDA build, several GB, where no
#               CPU build is at hand; the wheel's torch parts load into either build)
#   --no-tf     skips tensorflow-cpu and the TensorFlow step
set -euo pipefail
python=python3
torch=1
tf=1
wheel=""
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python="$2"; shift 2 ;;
    --no-torch) torch=""; shift ;;
    --no-tf) tf=""; shift ;;
    -h | --help) sed -n '2,11p' "$0" | cut -c3-; exit 0 ;;
    -*) echo "test_wheel: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) wheel="$(realpath "$1")"; shift ;;
  esac
done
python="$(command -v "$python" || true)"
if [ -z "$python" ]; then
  echo "test_wheel: --python names no Python on PATH" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
tag="$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
if [ -z "$wheel" ]; then
  wheel="$(ls -t dist/commsched-*-"$tag"-"$tag"-*manylinux*.whl 2> /dev/null | head -n 1 || true)"
  if [ -z "$wheel" ]; then
    echo "test_wheel: no $tag wheel in dist/: run scripts/build_wheels.sh $python first" >&2
    exit 2
  fi
  wheel="$(realpath "$wheel")"
fi
step() { printf 'test_wheel: %s (%d s)\n' "$1" "$SECONDS"; }
work="$(mktemp -d)"
# Absolute: the tests below run with a PATH that holds no rm.
remove="$(command -v rm)"
trap '"$remove" -rf "$work"' EXIT
venv="$work/venv"

packages=(mpich mpi4py)
[ -n "$torch" ] && packages+=(torch==2.13.0)
[ -n "$tf" ] && packages+=('tensorflow-cpu==2.21.*')
step "fresh $tag venv in $venv; installing ${packages[*]}"
"$python" -m venv "$venv"
# A find-links or index folder that lacks a package is not news here.
quiet() { "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }
quiet "$venv/bin/pip" install -q "${packages[@]}"
step "installing $(basename "$wheel")"
quiet "$venv/bin/pip" install -q "$wheel"

# Only the venv's own programs and a few shell tools: no g++, c++, gcc or clang++ can be found.
mkdir "$work/bin"
for tool in sh bash env grep tee timeout cat; do ln -s "$(command -v "$tool")" "$work/bin/$tool"; done
export PATH="$venv/bin:$work/bin" CC=/bin/false CXX=/bin/false
for compiler in g++ c++ gcc cc clang++; do
  if command -v "$compiler" > /dev/null; then
    echo "test_wheel: $compiler is still on PATH" >&2
    exit 1
  fi
done
# An empty cache: TensorFlow ops compiled earlier on this machine cannot stand in for the wheel's.
export COMMSCHED_TF_OPS_DIR="$work/tf-ops-cache" TF_CPP_MIN_LOG_LEVEL=2
cd "$work"

step "commsched-info"
commsched-info | tee info.txt
for part in commsched._core commsched._mpi commsched._nccl; do
  grep -Eq "^  $part +yes" info.txt || { echo "test_wheel: $part is not in the wheel" >&2; exit 1; }
done

cat > allreduce.py << 'EOF'
import numpy as np

import commsched

commsched.init()
out = commsched.allreduce(np.full(4, commsched.rank() + 1.0, np.float32), name="x", op="sum")
assert commsched.config()["transport"] == "mpi", commsched.config()["transport"]
assert out.tolist() == [3.0] * 4, out
print(f"rank {commsched.rank()}: MPI allreduce {out.tolist()}")
commsched.shutdown()
EOF
step "2-rank MPI allreduce"
timeout 120 mpiexec -n 2 python -m mpi4py allreduce.py

if [ -n "$torch" ]; then
  cat > gloo_step.py << 'EOF'
import torch

import commsched
import commsched.torch as ct

commsched.init()
assert commsched.config()["transport"] == "gloo", commsched.config()["transport"]
assert commsched.gloo_built(), "the wheel's native Gloo did not load"
torch.manual_seed(commsched.rank())
model = torch.nn.Linear(8, 2)
ct.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
model(torch.randn(4, 8)).sum().backward()
optimizer.step()
weights = ct.allgather(model.weight.detach().reshape(1, -1), name="w")
assert torch.equal(weights[0], weights[1]), "the ranks took different steps"
print(f"rank {commsched.rank()}: Gloo step done with native Gloo")
commsched.shutdown()
EOF
  step "2-rank torchrun Gloo training step"
  timeout 180 torchrun --nproc-per-node 2 gloo_step.py
fi

if [ -n "$tf" ]; then
  cat > tf_step.py << 'EOF'
import os

import numpy as np
import tensorflow as tf

import commsched.tensorflow as hvd
from commsched.tensorflow import _build

hvd.init()
library, why = _build.usable_prebuilt(tf.__version__)
assert library is not None, why
summed = hvd.allreduce(tf.fill([3], float(hvd.rank() + 1)), op=hvd.Sum, name="eager")
assert summed.numpy().tolist() == [3.0] * 3, summed
# A gradient step inside tf.function, through the custom allreduce op and its gradient.
variable = tf.Variable(np.full(2, float(hvd.rank()), np.float32))


@tf.function
def step(x: tf.Tensor) -> tf.Tensor:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(variable * x)
    tape = hvd.DistributedGradientTape(tape)
    (gradient,) = tape.gradient(loss, [variable])
    variable.assign_sub(0.5 * gradient)
    return loss


hvd.broadcast_variables([variable], root_rank=0)
step(tf.constant([1.0, 2.0]) * float(hvd.rank() + 1))
gathered = hvd.allgather(tf.reshape(variable, [1, -1]), name="after").numpy()
assert np.array_equal(gathered[0], gathered[1]), gathered
assert gathered[0].tolist() == [-0.75, -1.5], gathered  # 0 - 0.5 * mean([1, 2], [2, 4])
assert not os.path.exists(os.environ["COMMSCHED_TF_OPS_DIR"]), "the ops were compiled, not loaded"
print(f"rank {hvd.rank()}: TensorFlow ops from the wheel ({library.name}), step done")
hvd.shutdown()
EOF
  step "2-rank MPI TensorFlow ops step"
  timeout 240 mpiexec -n 2 python -m mpi4py tf_step.py
fi
step "all passed"
