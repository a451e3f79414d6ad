"""Saved state of a CUDA model on a real GPU (skipped without one), one rank over NCCL: an elastic
commit holds exactly the committed parameters and optimizer state while training goes on (its copies
run on a side stream behind the last update), and a Checkpointer round trip gives them back on their
devices, unsharded and with shard=True.

scripts/gpu_check.sh runs this file in its section (a).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)", allow_module_level=True)
import commsched.torch as ct
from commsched.torch.elastic import TorchState

import commsched

DEVICE = "cuda"
MODES = [
    pytest.param(False, False, id="barrier"),
    pytest.param(True, False, id="overlap"),
    pytest.param(False, True, id="shard"),
    pytest.param(True, True, id="shard-overlap"),
]


pytestmark = pytest.mark.usefixtures("no_commsched")


def _build(overlap: bool, sharded: bool) -> tuple[torch.nn.Module, Any, torch.Tensor]:
    """A small MLP on the GPU with Adam behind DistributedOptimizer, and one input batch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 4),
    ).to(DEVICE)
    optimizer = ct.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.05), model=model, overlap_forward=overlap, shard=sharded
    )
    return model, optimizer, torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)


def _step(model: torch.nn.Module, optimizer: Any, data: torch.Tensor) -> None:
    optimizer.zero_grad()
    model(data).square().mean().backward()
    optimizer.step()


def _parameters(model: torch.nn.Module, optimizer: Any) -> list[torch.Tensor]:
    """Copies of the parameters as the next forward sees them (overlap and sharded: their updates and
    gathers applied)."""
    if optimizer.pending_updates():
        optimizer.apply_pending_updates()
    return [p.detach().clone() for p in model.parameters()]


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Every parameter on the device under test and equal to the expected one, bit for bit."""
    for index, (value, expected) in enumerate(zip(got, want, strict=True)):
        assert value.device.type == DEVICE and torch.equal(value, expected), index


@pytest.mark.parametrize(("overlap", "sharded"), MODES)
def test_restore_gives_the_commit_after_training_went_on(overlap: bool, sharded: bool) -> None:
    """commit() mid-training, three more steps, restore(): every parameter equals its committed value,
    and training from there repeats the steps after the commit exactly."""
    model, optimizer, data = _build(overlap, sharded)
    state = TorchState(model, optimizer, epoch=0)
    for _ in range(3):
        _step(model, optimizer, data)
    state.commit()
    committed = _parameters(model, optimizer)
    for _ in range(3):
        _step(model, optimizer, data)
    after_three = _parameters(model, optimizer)
    state.wait()
    assert any(not torch.equal(a, b) for a, b in zip(after_three, committed))
    state.restore()
    _assert_equal(_parameters(model, optimizer), committed)
    for _ in range(3):
        _step(model, optimizer, data)
    _assert_equal(_parameters(model, optimizer), after_three)


@pytest.mark.parametrize(("overlap", "sharded"), MODES)
def test_checkpointer_round_trip_on_the_gpu(overlap: bool, sharded: bool, tmp_path: Path) -> None:
    """save() at step 2 while training goes on, load() into a fresh model and optimizer: the parameters
    of step 2 on the GPU, and two more steps from there equal two more steps of the original."""
    model, optimizer, data = _build(overlap, sharded)
    checkpointer = ct.Checkpointer(model, optimizer, directory=tmp_path)
    for _ in range(2):
        _step(model, optimizer, data)
    checkpointer.save(2)
    saved = _parameters(model, optimizer)
    for _ in range(2):
        _step(model, optimizer, data)
    later = _parameters(model, optimizer)
    checkpointer.wait()
    checkpointer.close()
    commsched.shutdown()

    fresh, fresh_optimizer, _ = _build(overlap, sharded)
    loader = ct.Checkpointer(fresh, fresh_optimizer, directory=tmp_path)
    restored = loader.load()
    assert restored is not None and restored.step == 2
    _assert_equal(_parameters(fresh, fresh_optimizer), saved)
    for _ in range(2):
        _step(fresh, fresh_optimizer, data)
    _assert_equal(_parameters(fresh, fresh_optimizer), later)
    loader.close()
