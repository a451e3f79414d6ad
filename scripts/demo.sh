#!/usr/bin/env bash
# The main job: sets up the environment, then trains a VGG-style model on 2 ranks joined
# by a rate-limited link (network namespaces + tc tbf; needs root), once per variant in one
# run: PyTorch DDP and commsched fifo (the unscheduled baselines), commsched priority with a
# barrier, and commsched priority with forward overlap. Prints the table, writes out/demo.json.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
mkdir -p out
python benchmarks/torch_vgg.py --json out/demo.json "$@"
