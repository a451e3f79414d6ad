"""train.py for a node that joins under torchrun: with ELASTIC_JOIN="EPOCH:STEP:SIZE", in that step
the rank launched as 0 of a job of SIZE ranks writes ELASTIC_OUT/join (the test then starts another
agent) and waits there, before its commit, until torchrun's agent stops it to restart the workers at
the new size."""

from __future__ import annotations

import os
import time

import commsched.torch as hvd
import train
from commsched.torch import elastic

_WAIT_S = 60.0  # longer than an agent's start; the test's own timeout ends a run that never grows


def wait_for_the_join(state: elastic.TorchState, epoch: int, step: int) -> None:
    """Per ELASTIC_JOIN: asks for the new agent and waits for torchrun's SIGTERM."""
    spec = os.environ.get("ELASTIC_JOIN", "").split(":")
    if train.LAUNCH_ID != 0 or spec[:2] != [str(epoch), str(step)] or hvd.size() != int(spec[2]):
        return
    (train.OUT / "join").write_text(str(time.time()))
    train.note_time("join asked")
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    train.grow_here = wait_for_the_join
    train.main()
