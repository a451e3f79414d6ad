"""commsched.tensorflow's SyncBatchNormalization and elastic training, at 2 ranks.

SyncBatchNormalization against one BatchNormalization over every rank's rows, and the elastic
states' sync/restore/commit, under mpiexec; then a Keras model trained under
`commsched-run -n 2 --min-np 1` where a rank SIGKILLs itself after an uncommitted step: the
survivor rolls back to the commit, re-forms alone and ends with the weights of an undisturbed run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "tf_ranks"))
from tf_launcher import have_mpiexec, launch, verdicts

pytest.importorskip("tensorflow")

ROOT = Path(__file__).resolve().parent.parent
ELASTIC_SCRIPT = ROOT / "tests" / "tf_ranks" / "elastic_train.py"
STEPS, FEATURES, ROWS, LEARNING_RATE = 8, 3, 4, 0.125  # as in the rank script
CHECKS = ["sync-batch-norm", "tensorflow-state", "keras-state", "keras-callbacks"]


@pytest.mark.skipif(not have_mpiexec(), reason="needs mpiexec and mpi4py")
def test_sync_batch_norm_and_elastic_states() -> None:
    """Every check passes on both ranks."""
    result = launch(2, "sync_bn_state.py", timeout=120)
    passes, failures = verdicts(result)
    tail = result.stdout[-6000:]
    assert not failures and result.returncode == 0, tail
    assert sorted(passes) == sorted(CHECKS * 2), tail


def reference_kernel() -> np.ndarray:
    """The weights of STEPS undisturbed steps: the gradient of sum(x @ w) is the column sums of x."""
    total = sum(
        np.random.default_rng(step).integers(-3, 4, (ROWS, FEATURES)).astype(np.float32).sum(axis=0)
        for step in range(STEPS)
    )
    return -LEARNING_RATE * total


@pytest.mark.parametrize("await_stop", [False, True], ids=["in-a-collective", "before-apply"])
def test_killed_rank_survivor_continues_from_the_commit(tmp_path: Path, await_stop: bool) -> None:
    """Rank 1 dies after applying step 4 (step 3 was the last commit): rank 0 restores, re-forms alone,
    redoes step 4 once and ends with the weights of a run that lost nothing, whether the loss
    shows inside a collective or at the start of the next optimizer.apply()."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")
    }
    env.update(
        ELASTIC_OUT=str(tmp_path),
        ELASTIC_KILL="1",
        ELASTIC_KILL_STEP="4",
        COMMSCHED_TRANSPORT="grpc",
        TF_CPP_MIN_LOG_LEVEL="2",
        ELASTIC_AWAIT_STOP="1" if await_stop else "0",
    )
    command = [sys.executable, "-m", "commsched.run", "-n", "2", "--min-np", "1", str(ELASTIC_SCRIPT)]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    restored = json.loads((tmp_path / "restored.json").read_text())
    assert restored == {"batch": 4, "size": 1}, restored
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["size"] == 1 and final["batch"] == STEPS
    assert final["applied"] == list(range(STEPS)), "a step was lost or applied twice"
    np.testing.assert_array_equal(np.array(final["kernel"], np.float32), reference_kernel())
