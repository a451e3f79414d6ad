"""A torch.compile'd model trains through commsched with the losses of eager training under a plain
optimizer: one rank on loopback in barrier and overlap mode, and two ranks under torchrun against
torch_common's one-process reference.

The model is always compiled from the module the optimizer is given as model=, the way users write
it: ``compiled = torch.compile(model)``, ``DistributedOptimizer(opt, model=model)``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import commsched.torch as ct
import torch.nn.functional as F

import commsched

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from mpirun import unglue
from torch_launcher import launch

STEPS = 6
TOLERANCE = 1e-5
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]


@pytest.fixture
def loopback() -> Iterator[None]:
    """One rank on loopback; Dynamo's caches emptied afterwards, so each test compiles from scratch."""
    if commsched.is_initialized():
        commsched.shutdown()
    commsched.init(transport="loopback")
    yield
    commsched.shutdown()
    torch._dynamo.reset()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(net: Any, optimizer: torch.optim.Optimizer) -> list[float]:
    generator = torch.Generator().manual_seed(1)
    xs, ys = (
        torch.randn(STEPS, 8, 16, generator=generator),
        torch.randint(0, 4, (STEPS, 8), generator=generator),
    )
    losses = []
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _compiled_run(backend: str, overlap: bool) -> None:
    eager = _mlp()
    want = _train(eager, _sgd(eager))
    model = _mlp()
    compiled = torch.compile(model, backend=backend)
    optimizer = ct.DistributedOptimizer(_sgd(model), model=model, overlap_forward=overlap)
    got = _train(compiled, optimizer)
    optimizer.synchronize()
    assert max(abs(a - b) for a, b in zip(got, want)) <= TOLERANCE, (got, want)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=TOLERANCE)
    # From the second step on the compiled backward's hooks filled one bucket, in forward order.
    assert optimizer.buckets() == [NAMES]
    assert commsched.stats()["launches"] > 0


@pytest.mark.usefixtures("loopback")
def test_compiled_model_in_barrier_mode_matches_eager() -> None:
    """torch.compile's default backend, inductor (C++ kernels built with g++: about 15-25 s here, once)."""
    _compiled_run("inductor", overlap=False)


@pytest.mark.usefixtures("loopback")
def test_compiled_model_in_overlap_mode_matches_eager() -> None:
    """Overlap mode with a compiled model: its per-module waits run eagerly between compiled pieces."""
    _compiled_run("aot_eager", overlap=True)


def test_two_ranks_under_torchrun_match_the_one_process_reference() -> None:
    """Two Gloo ranks train a compiled Net (frozen, unused and per-rank skipped layers; small partitions,
    several buckets) in barrier mode and end with the eager one-process reference's weights."""
    result = launch("torchrun", 2, "compiled.py", "--modes", "barrier", timeout=120)
    output = unglue(result.stdout, "PASS ", "FAIL ")
    assert result.returncode == 0, output[-4000:]
    assert len(re.findall(r"^PASS compiled/barrier ", output, re.MULTILINE)) == 2, output[-4000:]
