"""One rank: replays a scaled VGG-16 step under a run of reconfigure() switches.

Every switch lands while the other rank may still be mid-iteration, so each rank must pop the
same units in the same order across settings changes; a divergence hangs the collectives,
which the short stall timeouts the test sets turn into a failure. Prints PASS on rank 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import autotune_rig

import commsched
from commsched.bench import schedule


def main() -> int:
    """Runs the first points of the autotune rig's grid, a few iterations each."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    layers = schedule.timed_layers(schedule.load_model("vgg16"), 100.0, 32.0)
    layers = schedule.rescale_compute(layers, 0.14 / schedule.compute_s(layers))
    grads = [
        np.random.default_rng(rank).random(n, dtype=np.float32) for layer in layers for _, n in layer.params
    ]
    commsched.init(transport="mpi")
    for point in autotune_rig.grid(schedule.gradient_bytes(layers))[: int(sys.argv[1])]:
        commsched.reconfigure(**point)
        comm.Barrier()
        schedule.replay(layers, grads, "overlap", 4, 2)
    commsched.shutdown()
    if rank == 0:
        print("PASS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
