#!/usr/bin/env python3
"""Where shard=True's step() spends its time on the rig: when each bucket's reduce-scatter lands, its update.

Trains the model of benchmarks/torch_shard_rig.py at 2 ranks on the shaped link and prints, for rank 0
and each timed iteration, forward, backward and step() milliseconds and, after the backward's end,
when step() took each bucket's reduce-scatter (L) and updated it (U), start-end:

    python benchmarks/torch_shard_step_timing.py --model vgg --rate 1231mbit
    python benchmarks/torch_shard_step_timing.py --model transformer --variants shard

Variants as in torch_shard_rig.py: shard (the pipelined step), shard_wait (every reduce-scatter first).
Needs root (network namespaces and tc); see benchmarks/netrig.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TAG = "SHARD_STEP_TIMING "


def worker(variant: str, model: str, iterations: int) -> None:
    """Runs inside a rank: trains, timing each step's takes and updates; rank 0 prints them as JSON."""
    import torch
    import torch_shard_rig as rig
    from commsched.torch import _shard_step

    torch.set_num_threads(1)
    net = rig.build(model)
    call, optimizer, _, finish, rank = rig._setup(variant, net)
    marks: list[tuple[str, str, float, float]] = []
    take, update = _shard_step.take, _shard_step.update

    def timed_take(bucket: Any, timeout: float | None) -> None:
        started = time.perf_counter()
        take(bucket, timeout)
        marks.append(("L", bucket.name, started, time.perf_counter()))

    def timed_update(inner: Any, buckets: list[Any], unused: set[int], updating: Any) -> None:
        started = time.perf_counter()
        update(inner, buckets, unused, updating)
        marks.append(("U", ",".join(b.name for b in buckets), started, time.perf_counter()))

    _shard_step.take, _shard_step.update = timed_take, timed_update
    x, y = rig.batch_for(model, 64 if model == "vgg" else 8, rank)
    rows = []
    for _ in range(iterations + 3):
        marks.clear()
        started = time.perf_counter()
        optimizer.zero_grad()
        out = call(x)
        forward = time.perf_counter()
        rig.loss_of(out, y).backward()
        backward = time.perf_counter()
        optimizer.step()
        done = time.perf_counter()
        spans = [(what, name, a - backward, b - backward) for what, name, a, b in marks]
        rows.append(
            {
                "forward": forward - started,
                "backward": backward - forward,
                "step": done - backward,
                "spans": spans,
            }
        )
    finish()
    if rank == 0:
        sizes = [b.shard.numel() for b in optimizer._buckets]
        print(
            TAG + json.dumps({"variant": variant, "shard_elements": sizes, "iterations": rows[3:]}),
            flush=True,
        )
    import commsched

    commsched.shutdown()


def main() -> int:
    """Runs each variant on one rig and prints its iterations."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", choices=("vgg", "transformer"), default="vgg")
    parser.add_argument("--variants", default="shard_wait,shard")
    parser.add_argument("--rate", default="1231mbit", help="link rate")
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.iterations)
        return 0
    sys.path.insert(0, str(HERE))
    from local_ranks import run_on_rig
    from netrig import NetRig

    with NetRig(n_ranks=2, rate=args.rate) as rig:
        for k, variant in enumerate(args.variants.split(",")):
            argv = [sys.executable, str(Path(__file__).resolve()), "--worker", variant]
            argv += ["--model", args.model, "--iterations", str(args.iterations)]
            env = {
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
                ),
            }
            result = run_on_rig(rig, argv, env, 29700 + k, 300, TAG, variant)
            print(f"{variant}: shard elements per bucket {result['shard_elements']}")
            for row in result["iterations"]:
                spans = "  ".join(f"{w}{n} {1e3 * a:.0f}-{1e3 * b:.0f}" for w, n, a, b in row["spans"])
                print(
                    f"  forward {1e3 * row['forward']:.0f} backward {1e3 * row['backward']:.0f} "
                    f"step {1e3 * row['step']:.0f} ms: {spans}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
