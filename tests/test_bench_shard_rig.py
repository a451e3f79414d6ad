"""benchmarks/torch_shard_rig.py's ranks (run here without the rig, on this host's loopback): each
sharding variant holds half the gradient and optimizer-state bytes of DDP at 2 ranks, as its table says."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from local_ranks import run_ranks  # beside the benchmark


@pytest.mark.parametrize("model", ["transformer"])
def test_sharding_variants_hold_half_of_ddp_at_two_ranks(model: str) -> None:
    """FSDP2 and commsched shard=True hold 1/2 of DDP's gradients and Adam moments (within 5%)."""
    held = {}
    for variant in ("ddp", "fsdp2", "shard"):
        argv = [sys.executable, str(BENCHMARKS / "torch_shard_rig.py"), "--worker", variant, "--model", model]
        argv += ["--batch", "2", "--warmup", "1", "--iterations", "1"]
        result = run_ranks(argv, 2, 180, "SHARD_RIG_RESULT ", f"{variant} ({model})")
        assert result["variant"] == variant and result["seconds_per_iteration"] > 0
        held[variant] = (result["grad_bytes"], result["state_bytes"])
    full_grads, full_state = held["ddp"]
    assert full_state == 2 * full_grads  # Adam: two moments per parameter
    for variant in ("fsdp2", "shard"):
        grads, state = held[variant]
        assert abs(grads / full_grads - 0.5) <= 0.025, (variant, held)
        assert abs(state / full_state - 0.5) <= 0.025, (variant, held)
