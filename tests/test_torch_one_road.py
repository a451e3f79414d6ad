"""The torch plug-in has one road: every gradient and broadcast, CPU or CUDA, goes through commsched.

torch.distributed's collectives are made to raise, so any call to them fails the test. The CPU path
runs on the loopback transport; the CUDA path runs on commsched's NCCL transport over the fake
libnccl/libcudart of tests/fake_cuda.py, with parameters that report is_cuda=True (the attribute the
plug-in routes on) and torch tensors presented to commsched as device memory (host memory stands in
for the GPU, as everywhere in the fake).
"""

from __future__ import annotations

import copy
import ctypes
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
import commsched.torch as ct
import torch.distributed as dist
import torch.nn.functional as F
from fake_cuda import calls

import commsched
from commsched import buffers

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch_ranks"))
from fake_gpu import CudaParameter, claim_cuda, device_view
from torch_common import Net, data, max_difference, shard, skips

_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_reduce_coalesced", "reduce")


@pytest.fixture(autouse=True)
def no_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every torch.distributed collective raises; commsched is shut down around each test."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("commsched.torch called a torch.distributed collective")

    for name in _COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, refuse)
    if commsched.is_initialized():
        commsched.shutdown()
    yield
    commsched.shutdown()


@pytest.fixture
def submitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str, int]]:
    """(kind, name, dtype, bytes) of everything handed to commsched's async calls, in order."""
    seen: list[tuple[str, str, str, int]] = []
    allreduce, broadcast = commsched.allreduce_async, commsched.broadcast_async

    def spy_allreduce(array: Any, name: str | None = None, priority: int = 0, op: str = "sum") -> Any:
        seen.append(("allreduce", str(name), str(array.dtype), array.numel() * array.element_size()))
        return allreduce(array, name=name, priority=priority, op=op)

    def spy_broadcast(array: Any, root: int = 0, name: str | None = None, priority: int = 0) -> Any:
        seen.append(("broadcast", str(name), str(array.dtype), array.numel() * array.element_size()))
        return broadcast(array, root=root, name=name, priority=priority)

    monkeypatch.setattr(commsched, "allreduce_async", spy_allreduce)
    monkeypatch.setattr(commsched, "broadcast_async", spy_broadcast)
    return seen


@pytest.fixture
def torch_as_device_memory(nccl_env: ctypes.CDLL, monkeypatch: pytest.MonkeyPatch) -> ctypes.CDLL:
    """commsched sees torch tensors as CUDA memory ready on the legacy default stream (the fake NCCL
    reduces host memory); yields the fake library's handle."""
    monkeypatch.setattr(buffers, "_gpu_view", device_view)
    return nccl_env


def _train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    passes: int = 1,
    between: Callable[[], None] | None = None,
) -> None:
    x, y = data(1)
    for step in range(steps):
        optimizer.zero_grad()
        for p in range(passes):
            at = step * passes + p
            loss = F.cross_entropy(model(shard(x[at], 0), skips(0, at)), shard(y[at], 0))
            (loss / passes).backward()
        if between is not None:
            between()
        optimizer.step()


def _trainable(model: torch.nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def _check_reduced(
    submitted: list[tuple[str, str, str, int]], wrapped: Any, model: torch.nn.Module
) -> set[str]:
    """The first step sends each gradient alone, the later ones in buckets covering every trainable
    parameter; returns the wire dtypes of the gradients."""
    buckets = wrapped._reducer.buckets()
    alone, bucketed, dtypes = set(), set(), set()
    for kind, name, dtype, _ in submitted:
        if kind != "allreduce":
            continue
        short = name.split(".", 2)[2]
        if name in buckets:
            bucketed.update(buckets[name])
        elif short.startswith("bucket"):
            raise AssertionError(f"{name} is no bucket of the optimizer's layout {sorted(buckets)}")
        else:
            alone.add(short)
        if short not in ("used", "layout0"):
            dtypes.add(dtype)
    assert alone == _trainable(model) | {"used", "layout0"}, alone
    assert bucketed == _trainable(model), bucketed
    return dtypes


def test_cpu_gradients_go_through_commsched(submitted: list[tuple[str, str, str, int]]) -> None:
    """CPU gradients: every trainable parameter and the used counts are submitted to commsched."""
    commsched.init(transport="loopback")
    torch.manual_seed(0)
    model = Net()
    plain_model = copy.deepcopy(model)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    wrapped = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model)
    _train(plain_model, plain, 3)
    _train(model, wrapped, 3)
    assert max_difference(model, plain_model) < 1e-6
    assert _check_reduced(submitted, wrapped, model) == {"torch.float32"}


@pytest.mark.parametrize(
    ("overlap", "passes", "compression"),
    [
        (False, 1, None),
        (True, 1, None),
        (False, 2, None),
        (True, 2, None),
        (False, 1, "fp16"),
        (True, 1, "bf16"),
    ],
)
def test_cuda_gradients_go_through_commsched_nccl(
    torch_as_device_memory: ctypes.CDLL,
    submitted: list[tuple[str, str, str, int]],
    overlap: bool,
    passes: int,
    compression: str | None,
) -> None:
    """CUDA parameters: DistributedOptimizer starts commsched on NCCL itself, and every gradient (in
    the wire dtype when compressed) and the used counts travel through it; the weights equal a plain
    optimizer's (one rank: the average is the gradient itself)."""
    torch.manual_seed(0)
    model = claim_cuda(Net())
    plain_model = copy.deepcopy(model)
    plain = torch.optim.Adam(plain_model.parameters(), lr=1e-2)
    wrapped = ct.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-2),
        model=model,
        overlap_forward=overlap,
        backward_passes_per_step=passes,
        compression=compression,
    )
    assert commsched.config()["transport"] == "nccl"
    _train(plain_model, plain, 3, passes)
    _train(model, wrapped, 3, passes)
    wrapped.synchronize()
    assert max_difference(model, plain_model) < (1e-6 if compression is None else 2e-2)
    wire = {None: "torch.float32", "fp16": "torch.float16", "bf16": "torch.bfloat16"}[compression]
    assert _check_reduced(submitted, wrapped, model) == {wire}
    # Every submitted byte went through NCCL (several small gradients may share one fused launch).
    assert any(c.startswith("allreduce") for c in calls(torch_as_device_memory))
    assert commsched.stats()["launched_bytes"] >= sum(nbytes for kind, _, _, nbytes in submitted)


def test_cuda_broadcasts_go_through_commsched_nccl(
    torch_as_device_memory: ctypes.CDLL, submitted: list[tuple[str, str, str, int]]
) -> None:
    """broadcast_parameters and broadcast_optimizer_state of CUDA tensors use commsched's broadcast; on
    one rank the state comes back unchanged, and Adam's step stays a CPU tensor."""
    torch.manual_seed(0)
    model = claim_cuda(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    before_weights = copy.deepcopy(model.state_dict())
    before_state = copy.deepcopy(optimizer.state_dict())
    ct.broadcast_parameters(model.named_parameters(), root_rank=0)  # state_dict() would drop the claim
    ct.broadcast_optimizer_state(optimizer, root_rank=0)
    assert commsched.config()["transport"] == "nccl"
    for name, value in model.state_dict().items():
        assert torch.equal(value, before_weights[name]), name
    after = optimizer.state_dict()
    for index, state in before_state["state"].items():
        for key, value in state.items():
            assert torch.equal(after["state"][index][key], value), (index, key)
    kinds = {kind for kind, _, _, _ in submitted}
    assert kinds == {"broadcast"}
    assert len([s for s in submitted if s[1].startswith("torch.bcast")]) == len(list(model.parameters()))
    assert any(c.startswith("broadcast") for c in calls(torch_as_device_memory))


def test_allreduce_helpers_of_cuda_tensors_go_through_commsched(
    torch_as_device_memory: ctypes.CDLL, submitted: list[tuple[str, str, str, int]]
) -> None:
    """ct.allreduce / allreduce_ on a CUDA tensor start commsched on NCCL and reduce through it."""
    tensor = CudaParameter(torch.arange(6.0).reshape(2, 3), requires_grad=False)
    assert torch.equal(ct.allreduce(tensor, name="avg"), tensor)
    assert commsched.config()["transport"] == "nccl"
    ct.allreduce_(tensor, name="in_place")
    assert torch.equal(tensor, torch.arange(6.0).reshape(2, 3))
    assert [name for _, name, _, _ in submitted] == ["allreduce.avg", "allreduce.in_place"]  # Horovod's names


def test_mixing_cpu_and_cuda_parameters_is_refused() -> None:
    """One CUDA and one CPU parameter in an optimizer: the error names one of each and the fix."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].weight = CudaParameter(model[1].weight.detach().clone())
    with pytest.raises(
        ValueError, match=r"'1\.weight' is on a GPU but parameter '0\.weight' is on the CPU.*model\.to"
    ):
        ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    assert not commsched.is_initialized()


def test_cuda_parameters_under_a_host_transport_are_refused() -> None:
    """commsched already running a host transport: CUDA parameters are refused with the fix, at once."""
    commsched.init(transport="loopback")
    model = claim_cuda(torch.nn.Linear(2, 2))
    with pytest.raises(
        TypeError,
        match=r"'weight' is on a GPU, but commsched runs the loopback transport on host memory.*device='cuda'",
    ):
        ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)


def test_cpu_parameters_under_nccl_are_refused(torch_as_device_memory: ctypes.CDLL) -> None:
    """commsched running NCCL: CPU parameters are refused with the fix."""
    commsched.init(device="cuda")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(
        TypeError,
        match=r"'weight' is on the CPU, but commsched runs the nccl transport on GPU memory.*model\.to\('cuda'\)",
    ):
        ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
