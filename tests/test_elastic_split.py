"""Unsharded commits on one host (elastic_split): each rank copies its part of the replicated
parameters and optimizer state into shared memory, and a restore joins them exactly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from commsched.torch import elastic_shm, elastic_split

RANKS_SCRIPT = """
import copy
import time
import torch
import commsched.torch as hvd
from commsched.torch.elastic import TorchState

torch.set_num_threads(1)
hvd.init()
torch.manual_seed(0)
# Sizes that do not divide by 3, a shared weight (two names), a tensor smaller than the rank count
# and a batch-norm buffer: everything must come back exactly.
first = torch.nn.Linear(37, 53)
model = torch.nn.Module()
model.net = torch.nn.Sequential(first, torch.nn.ReLU(), torch.nn.Linear(53, 2), torch.nn.BatchNorm1d(2))
model.alias = first  # the same parameters under a second name in the state_dict
optimizer = hvd.DistributedOptimizer(
    torch.optim.Adam(model.parameters(), lr=1e-2), named_parameters=model.named_parameters()
)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
state = TorchState(model, optimizer, epoch=0)
data = torch.randn(16, 37, generator=torch.Generator().manual_seed(hvd.rank()))


def step(pause=False):
    optimizer.zero_grad()
    model.net(data).square().mean().backward()
    if pause and hvd.rank() == 0:
        # The others restore while their last used counts still wait for this rank's: the fresh
        # reducer's first step must not submit its counts under a name still in flight.
        time.sleep(0.5)
    optimizer.step()


for _ in range(3):
    step()
state.commit()
step()
state.commit()
plan = state._background._cut_plan
for _ in range(3):  # every slot written again: the cut is planned once while nothing changes
    step()
    state.commit()
state.wait()
assert state._background._cut_plan is plan, "the cut was planned again with nothing changed"
# New state tensors (as a load_state_dict makes them): the next commit plans the cut afresh.
optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
step()
state.commit()
state.wait()
assert state._background._cut_plan is not plan, "the cut outlived the tensors it was planned for"
committed = state._background._committed
assert committed.shared and committed.splits, "the commit was not cut over the ranks"
model_then = copy.deepcopy(model.state_dict())
optimizer_then = copy.deepcopy(optimizer.state_dict())
for _ in range(3):
    step(pause=True)
state.restore()
for name, value in model.state_dict().items():
    assert torch.equal(value, model_then[name]), name
for index, values in optimizer_then["state"].items():
    for key, value in values.items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(optimizer.state_dict()["state"][index][key])), (index, key)
step()
print(f"rank {hvd.rank()} restored exactly", flush=True)
hvd.shutdown()
"""


def test_parts_cover_every_element_once() -> None:
    """Each rank's part of a tensor: together they cover it once, in order, for sizes that do not divide."""
    for numel in (3, 4, 5, 53, 1961):
        for ranks in (2, 3, 4):
            if numel < ranks:
                continue
            covered = []
            for rank in range(ranks):
                start, length = elastic_split.part(numel, ranks, rank)
                assert length <= elastic_split.reserved(numel, ranks)
                covered.extend(range(start, start + length))
            assert covered == list(range(numel))


def test_plan_join_and_fill_rebuild_the_tensors() -> None:
    """Parts copied into per-rank flat tensors join back into the parameters and optimizer state."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 5)).sum().backward()
    inner.step()
    ranks = 3
    params = [p for group in inner.param_groups for p in group["params"]]
    splits, totals = elastic_split.plan(model.state_dict(keep_vars=True), params, inner.state, ranks)
    assert {s.model for s in splits if s.model} == {"0.weight", "0.bias", "1.weight"}  # 1.bias: 1 element
    assert sum(1 for s in splits if s.name == "momentum_buffer") == 3
    flats = {(r, dtype): torch.full((n,), float("nan")) for r in range(ranks) for dtype, n in totals.items()}
    for split in splits:
        source = params[split.index] if not split.name else inner.state[params[split.index]][split.name]
        for rank in range(ranks):
            start, length = elastic_split.part(split.numel, ranks, rank)
            flats[(rank, split.dtype)][split.offset : split.offset + length] = source.detach().view(-1)[
                start : start + length
            ]
    joined = elastic_split.join(splits, flats, ranks)
    model_state: dict = {}
    optimizer_state: dict = {"state": {}}
    elastic_split.fill_model(model_state, {"0.weight": "0.weight", "tied.weight": "0.weight"}, splits, joined)
    elastic_split.fill_optimizer(optimizer_state, splits, joined)
    assert (
        torch.equal(model_state["0.weight"], model[0].weight)
        and model_state["tied.weight"] is model_state["0.weight"]
    )
    for split, tensor in zip(splits, joined, strict=True):
        expected = params[split.index] if not split.name else inner.state[params[split.index]][split.name]
        assert torch.equal(tensor, expected.detach())
    assert torch.equal(
        optimizer_state["state"][0]["momentum_buffer"], inner.state[params[0]]["momentum_buffer"]
    )


def test_three_ranks_restore_a_commit_cut_over_them_exactly(tmp_path: Path) -> None:
    """3 ranks on this host: the commit is cut over them, planned once while parameters and state keep
    their tensors and again when they change, and restore() gives the committed values bit for bit."""
    if elastic_shm.host_key() == 0:
        pytest.skip(f"no {elastic_shm.DIRECTORY} here")
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "commsched.run", "-n", "3", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("restored exactly") == 3, done.stdout[-2000:]
