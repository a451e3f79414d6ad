#!/usr/bin/env bash
# Builds commsched in place and checks its GPU path on this machine: GPU tests, correctness of every
# dtype and op, allreduce time against raw NCCL, a CUDA training run, and training step time against
# DDP (benchmarks/gpu_step_time.py: ResNet-50, ViT-B/16, GPT-2, torch.compile). Table on stdout, JSON
# in out/gpu_check.json and out/gpu_step_time.json (--out to change). Needs no internet: python3 must
# already have PyTorch with CUDA and NCCL (CuPy, torchvision and transformers optional: without
# transformers the GPT-2 row is skipped; --skip-step-time leaves the section out). --fake runs without a GPU on tests/fake_cuda.py's library (2 ranks,
# mpiexec). Exit status 0 only when every check passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

if "$PYTHON" -m pip install --no-build-isolation --no-deps --quiet -e . >/tmp/gpu_check_build.log 2>&1; then
  echo "commsched installed in place (pip install -e .)"
else
  echo "pip install -e . failed (log: /tmp/gpu_check_build.log); building the extensions in place instead"
  "$PYTHON" setup.py -q build_ext --inplace -j "$(nproc)"
  # The plug-ins live in plugins/ and are commsched.torch / commsched.tensorflow through these links.
  [ -e commsched/torch ] || ln -s ../plugins/torch commsched/torch
  [ -e commsched/tensorflow ] || ln -s ../plugins/tensorflow commsched/tensorflow
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PYTHON" benchmarks/gpu_check.py "$@"
