"""The torch plug-in on a real GPU (skipped without one): CUDA gradients through commsched's NCCL
transport, one rank. Every mode must give a plain optimizer's weights; gradients produced on a side
stream must be reduced after they are written; broadcasts keep each state tensor's device.

torch.distributed's collectives raise here, so nothing can take a road around the scheduler.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (run scripts/gpu_check.sh on a GPU machine)", allow_module_level=True)
import commsched.torch as ct
import torch.distributed as dist
import torch.nn.functional as F

import commsched

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from torch_common import Net, data, max_difference, shard, skips

TOLERANCE = {None: 1e-5, "fp16": 2e-2, "bf16": 5e-2}


@pytest.fixture(autouse=True)
def fresh_commsched(no_commsched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No commsched running before a test (the plug-in starts it), none after; no torch.distributed."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("commsched.torch called a torch.distributed collective")

    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        monkeypatch.setattr(dist, name, refuse)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, passes: int = 1) -> None:
    x, y = data(1)
    x, y = x.cuda(), y.cuda()
    for step in range(steps):
        optimizer.zero_grad()
        for p in range(passes):
            at = step * passes + p
            loss = F.cross_entropy(model(shard(x[at], 0), skips(0, at)), shard(y[at], 0))
            (loss / passes).backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("overlap", "passes", "compression", "sharded"),
    [
        (False, 1, None, False),
        (True, 1, None, False),
        (False, 2, None, False),
        (True, 2, None, False),
        (False, 1, "fp16", False),
        (True, 1, "bf16", False),
        (False, 1, None, True),
        (True, 1, None, True),
        (True, 2, None, True),
    ],
)
def test_cuda_training_matches_a_plain_optimizer(
    overlap: bool, passes: int, compression: str | None, sharded: bool
) -> None:
    """DistributedOptimizer starts commsched on NCCL and its weights equal a plain optimizer's, unsharded
    and with shard=True (reduce-scatter and all-gather on the GPU)."""
    torch.manual_seed(0)
    model = Net().cuda()
    plain_model = copy.deepcopy(model)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    wrapped = ct.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        model=model,
        overlap_forward=overlap,
        backward_passes_per_step=passes,
        compression=compression,
        shard=sharded,
    )
    assert commsched.config()["transport"] == "nccl"
    _train(plain_model, plain, 6, passes)
    _train(model, wrapped, 6, passes)
    wrapped.synchronize()
    assert max_difference(model, plain_model) < TOLERANCE[compression]
    assert commsched.stats()["launches"] > 0


def test_gradients_produced_on_a_side_stream() -> None:
    """Forward, backward and step on a side stream that starts late (a sleep kernel): the reduction
    must wait for the gradients that stream writes; the weights equal a plain optimizer's."""
    torch.manual_seed(0)
    model = Net().cuda()
    plain_model = copy.deepcopy(model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    wrapped = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    _train(plain_model, plain, 4)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x, y = data(1)
        x, y = x.cuda(), y.cuda()
        for step in range(4):
            wrapped.zero_grad()
            torch.cuda._sleep(20_000_000)  # the gradients below are written well after submit's host time
            F.cross_entropy(model(shard(x[step], 0), skips(0, step)), shard(y[step], 0)).backward()
            wrapped.step()
    torch.cuda.current_stream().wait_stream(side)
    assert max_difference(model, plain_model) < 1e-5


def test_broadcasts_keep_each_state_tensor_on_its_device() -> None:
    """broadcast_parameters / broadcast_optimizer_state of a CUDA model through commsched (one rank:
    unchanged); Adam's step stays on the CPU, its moments on the GPU."""
    torch.manual_seed(0)
    model = Net().cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8, device="cuda")).sum().backward()
    optimizer.step()
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict())
    ct.broadcast_parameters(model.state_dict(), root_rank=0)
    ct.broadcast_optimizer_state(optimizer, root_rank=0)
    assert commsched.config()["transport"] == "nccl"
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for index, entries in state["state"].items():
        for key, value in entries.items():
            got = optimizer.state_dict()["state"][index][key]
            assert got.device == value.device and torch.equal(got, value), (index, key)


def test_allreduce_helpers_and_mixed_parameters() -> None:
    """ct.allreduce of CUDA and (staged) CPU tensors; a CPU+CUDA optimizer is refused naming both."""
    t = torch.arange(6.0, device="cuda").reshape(2, 3).t()
    assert torch.equal(ct.allreduce(t), t)
    host = torch.arange(4, dtype=torch.int64)
    assert (
        torch.equal(ct.allreduce(host, op="sum"), host) and ct.allreduce(host, op="sum").device.type == "cpu"
    )
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).cuda())
    with pytest.raises(ValueError, match=r"'1\.weight' is on a GPU but parameter '0\.weight' is on the CPU"):
        ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
