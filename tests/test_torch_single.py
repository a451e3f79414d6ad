"""The torch plug-in on one rank (loopback): each mode against a plain optimizer, and its errors."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import commsched.torch as ct
import torch.nn.functional as F
from commsched.torch import _codec

import commsched

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from torch_common import FORWARD_ORDER, Net, data, max_difference, shard, skips

PER_PARAMETER: dict[str, Callable[[Any], Any]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd-nesterov-wd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2),
}


@pytest.fixture(autouse=True)
def loopback() -> Iterator[None]:
    if commsched.is_initialized():
        commsched.shutdown()
    commsched.init(transport="loopback")
    yield
    commsched.shutdown()


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = data(1)
    return F.cross_entropy(model(shard(x[step], 0), skips(0, step)), shard(y[step], 0))


def _train(
    model: torch.nn.Module, optimizer: Any, steps: int, between: Callable[[], None] | None = None
) -> None:
    for step in range(steps):
        optimizer.zero_grad()
        _loss(model, step).backward()
        if between is not None:
            between()
        optimizer.step()


@pytest.mark.parametrize("name", sorted(PER_PARAMETER))
@pytest.mark.parametrize("overlap", [False, True])
def test_matches_plain_optimizer(name: str, overlap: bool) -> None:
    """Barrier and overlap modes give the weights and state of the unwrapped optimizer."""
    torch.manual_seed(0)
    model = Net()
    plain_model = copy.deepcopy(model)
    plain = PER_PARAMETER[name](plain_model.parameters())
    wrapped = ct.DistributedOptimizer(
        PER_PARAMETER[name](model.parameters()), model=model, overlap_forward=overlap
    )
    _train(plain_model, plain, 8)
    _train(model, wrapped, 8)
    wrapped.synchronize()
    assert max_difference(model, plain_model) < 1e-6
    mine, theirs = wrapped.state_dict(), plain.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()


def test_priorities_follow_forward_order_not_declaration() -> None:
    """Net declares head before embed; the first forward pass decides the priorities."""
    torch.manual_seed(0)
    model = Net()
    optimizer = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    declared = optimizer.priorities()
    assert declared["head.weight"] < declared["embed.weight"]
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    measured = optimizer.priorities()
    assert sorted(FORWARD_ORDER, key=measured.__getitem__) == FORWARD_ORDER


def test_barrier_clipping_and_grad_scaler_settle_in_flight_gradients() -> None:
    """Touching an in-flight gradient in barrier mode waits for the reductions first."""
    torch.manual_seed(0)
    model = Net()
    plain_model = copy.deepcopy(model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    wrapped = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    for m, optimizer in ((plain_model, plain), (model, wrapped)):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for step in range(6):
            optimizer.zero_grad()
            scaler.scale(_loss(m, step)).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
            scaler.step(optimizer)
            scaler.update()
    assert max_difference(model, plain_model) < 1e-6
    assert type(model.embed.weight.grad) is torch.Tensor  # settled back to a plain tensor


def test_overlap_rejects_global_norm_clipping_with_a_clear_error() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = ct.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap_forward=True
    )
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="overlap_forward=False"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.synchronize()


def test_overlap_rejects_closure_optimizers_and_needs_a_model() -> None:
    model = Net()
    with pytest.raises(ValueError, match="barrier mode"):
        ct.DistributedOptimizer(torch.optim.LBFGS(model.parameters()), model=model, overlap_forward=True)
    with pytest.raises(ValueError, match="model="):
        ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), overlap_forward=True)
    with pytest.raises(ValueError, match="compression"):
        ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model, compression="int4")


def test_overlap_zero_grad_then_forward_starts_from_fresh_gradients() -> None:
    """zero_grad() while gradients are in flight must not let the next backward accumulate onto them."""
    torch.manual_seed(0)
    model = Net()
    optimizer = ct.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), model=model, overlap_forward=True
    )
    _loss(model, 0).backward()
    optimizer.step()
    optimizer.zero_grad()
    _loss(model, 1).backward()
    optimizer.step()
    optimizer.synchronize()
    fresh = copy.deepcopy(model)
    fresh.zero_grad()
    _loss(fresh, 1).backward()
    assert torch.allclose(model.embed.weight.grad, fresh.embed.weight.grad)


def test_wrapper_works_with_lr_scheduler_and_checkpoints() -> None:
    torch.manual_seed(0)
    model = Net()
    optimizer = ct.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _train(model, optimizer, 2, between=None)
    scheduler.step()
    assert optimizer.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    plain = torch.optim.SGD(Net().parameters(), lr=1.0, momentum=0.9)
    plain.load_state_dict(optimizer.state_dict())
    assert plain.param_groups[0]["lr"] == pytest.approx(0.05)
    assert torch.equal(
        plain.state_dict()["state"][1]["momentum_buffer"],
        optimizer.state[model.head.weight]["momentum_buffer"],
    )


def test_state_codec_round_trip_keeps_types() -> None:
    state = {
        "state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2, 2)}},
        "param_groups": [{"betas": (0.9, 0.99), "lr": 0.1, "params": [0], "x": None}],
    }
    skeleton, tensors = _codec.encode(state)
    specs = _codec.tensor_specs(skeleton)
    assert specs == [(torch.float32, []), (torch.float32, [2, 2])]
    back = _codec.decode(skeleton, tensors)
    assert back["param_groups"] == state["param_groups"]
    assert isinstance(back["param_groups"][0]["betas"], tuple) and 0 in back["state"]


def test_allreduce_helpers_on_one_rank() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    assert torch.equal(ct.allreduce(t), t)
    assert torch.equal(ct.allreduce(t, op="sum"), t)


@pytest.mark.parametrize("overlap", [False, True])
def test_only_barrier_mode_leaves_the_core_thread_asleep_for_what_step_waits_on(
    overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Barrier mode's last bucket and the used counts go in without waking the core's thread (the
    next wait runs the round itself); earlier buckets and overlap mode's buckets wake it."""
    woken: dict[str, list[bool]] = {}
    enqueue = commsched._core.enqueue

    def recording(*args: Any, **kwargs: Any) -> Any:
        woken.setdefault(args[0], []).append(kwargs.get("wake_core", True))
        return enqueue(*args, **kwargs)

    monkeypatch.setattr(commsched._core, "enqueue", recording)
    commsched.shutdown()
    commsched.init(transport="loopback", bucket_bytes=640)  # two buckets of two layers
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = ct.DistributedOptimizer(inner, model=model, overlap_forward=overlap)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        optimizer.step()
    optimizer.synchronize()
    buckets = sorted(name for name in woken if ".bucket" in name)
    assert len(buckets) == 2, woken
    used = [name for name in woken if name.endswith("used")]
    assert used, woken
    last_step = {name: flags[-1] for name, flags in woken.items()}
    assert not any(last_step[name] for name in used), woken
    if overlap:
        assert all(last_step[name] for name in buckets), woken
    else:
        # The first bucket to fill (the last layers') wakes the core; the last one does not.
        assert sorted(last_step[name] for name in buckets) == [False, True], woken
