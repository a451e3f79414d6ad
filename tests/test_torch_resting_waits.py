"""overlap_forward's per-module waits rest (their hooks out of the modules) once nothing is left to
settle, and are back when the next iteration closes: the updates stay those of a plain optimizer
when the forward order changes, layers are frozen and unfrozen, and forwards run without a step."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import commsched.torch as ct
from commsched.torch import _order

import commsched


@pytest.fixture(autouse=True)
def loopback() -> Iterator[None]:
    if commsched.is_initialized():
        commsched.shutdown()
    commsched.init(transport="loopback", bucket_bytes=200)  # a bucket per layer
    yield
    commsched.shutdown()


class Branches(torch.nn.Module):
    """Two branches whose order flips with `swap`, so the forward order is not always the recorded one."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(6, 6)
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor, swap: bool = False) -> torch.Tensor:
        x = torch.tanh(self.stem(x))
        first, second = (self.b, self.a) if swap else (self.a, self.b)
        x = torch.tanh(second(torch.tanh(first(x))))
        return self.head(x)


def _hooked(model: torch.nn.Module) -> list[bool]:
    return [bool(m._forward_pre_hooks) for m in (model.stem, model.a, model.b, model.head)]


def _train(model: Branches, optimizer: Any, steps: int, seen: list[list[bool]] | None = None) -> None:
    generator = torch.Generator().manual_seed(3)
    for step in range(steps):
        x = torch.randn(4, 6, generator=generator)
        if step == 3:
            model.a.requires_grad_(False)  # a new bucket layout from the next close
        if step == 5:
            model.a.requires_grad_(True)
        optimizer.zero_grad()
        out = model(x, swap=step % 2 == 1)
        if seen is not None:
            seen.append(_hooked(model))
        with torch.no_grad():
            model(x)  # a second forward with nothing to settle: every update is in already
        out.square().mean().backward()
        optimizer.step()


def test_resting_waits_give_the_plain_optimizer_result(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hooks rest once nothing is pending and come back at each close; the result is SGD's."""
    # Hooks never rest in a process where torch.compile traced a frame, as an earlier test may have.
    monkeypatch.setattr(_order, "_dynamo_ran", lambda: False)
    torch.manual_seed(0)
    model = Branches()
    plain_model = copy.deepcopy(model)
    wrapped = ct.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model, overlap_forward=True
    )
    seen: list[list[bool]] = []
    _train(model, wrapped, 8, seen)
    assert _hooked(model) == [True] * 4, "a closed iteration puts the hooks back"
    wrapped.synchronize()
    _train(plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9), 8)
    for mine, theirs in zip(model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert len(wrapped.buckets()) > 1
    # From the second step on, updates are pending when the forward starts and done after it: the
    # hooks rest then (the first forward has nothing to settle and leaves them in).
    assert seen[0] == [True] * 4
    assert all(hooked == [False] * 4 for hooked in seen[1:]), seen


def test_waits_never_rest_once_torch_compile_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_order, "_dynamo_ran", lambda: True)
    torch.manual_seed(0)
    model = Branches()
    wrapped = ct.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model=model, overlap_forward=True
    )
    seen: list[list[bool]] = []
    _train(model, wrapped, 3, seen)
    assert all(hooked == [True] * 4 for hooked in seen), seen
