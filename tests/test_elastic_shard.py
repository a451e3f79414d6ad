"""TorchState with DistributedOptimizer(shard=True): commit() captures this rank's shard in the
background and gathers every rank's there, restore() re-cuts the committed state, and after a SIGKILL
the survivors end with the parameters of a run started at their size from the restored commit. A
restore that falls back to the commit before a failed capture takes that commit's objects too."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import commsched.torch as cst
from commsched.torch import checkpoint_capture, elastic_commit
from commsched.torch.elastic import TorchState
from test_elastic import SAMPLES, assert_every_sample_once, launch, results

import commsched


def build(shard: bool) -> tuple[Any, Any, Any]:
    """Two layers, Adam (per-element moments, a per-parameter step) and one input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = cst.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.05),
        named_parameters=model.named_parameters(),
        model=model,
        shard=shard,
    )
    return model, optimizer, torch.randn(8, 16)


def step(model: Any, optimizer: Any, data: Any) -> None:
    optimizer.zero_grad()
    model(data).square().sum().backward()
    optimizer.step()


def plain(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """Copies of the parameters and of the optimizer state in per-parameter form."""
    state = optimizer.full_state_dict()["state"]
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        {i: {k: torch.as_tensor(v).clone() for k, v in s.items()} for i, s in state.items()},
    )


def assert_same(got: Any, expected: Any) -> None:
    assert got[0].keys() == expected[0].keys() and got[1].keys() == expected[1].keys()
    for name, tensor in got[0].items():
        assert torch.equal(tensor, expected[0][name]), name
    for index, values in got[1].items():
        assert values.keys() == expected[1][index].keys()
        for name, value in values.items():
            assert torch.equal(value, expected[1][index][name]), (index, name)


@pytest.mark.parametrize(
    ("shared_memory", "bucket_bytes"),
    [(True, None), (True, 256), (False, None)],
    ids=["shared-memory", "shared-memory-small-buckets", "broadcasts"],
)
def test_sharded_commit_is_captured_in_the_background(
    monkeypatch: pytest.MonkeyPatch, shared_memory: bool, bucket_bytes: int | None
) -> None:
    """commit() returns with the shard still to copy: the steps after it copy it first, on the training
    thread, while the capture waits; restore() gives the committed state, and training from it again
    repeats the step taken after the commit exactly (the state re-cut into shards). The shard is
    handed over in shared memory or, as across hosts, by broadcasts. In shared memory the parameters
    are committed only as each rank's shard of them and rebuilt from those, also where buckets of
    256 bytes hold a 2 KiB weight in pieces."""
    commsched.init(transport="loopback", **({} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}))
    try:
        _captured_in_the_background(monkeypatch, shared_memory)
    finally:
        commsched.shutdown()


def _captured_in_the_background(monkeypatch: pytest.MonkeyPatch, shared_memory: bool) -> None:
    monkeypatch.setattr(elastic_commit, "SHARED_MEMORY", shared_memory)
    model, optimizer, data = build(shard=True)
    state = TorchState(model, optimizer)
    step(model, optimizer, data)
    release = threading.Event()
    monkeypatch.setattr(elastic_commit, "lower_priority", lambda: release.wait(10))
    state.commit()
    running = state._background._running
    assert running is not None and running[0].is_alive(), "commit() copied everything before returning"
    committed = plain(model, optimizer)
    step(model, optimizer, data)
    after_one = plain(model, optimizer)
    step(model, optimizer, data)
    assert running[0].is_alive() and running[1].inline_copies > 0
    threading.Timer(0.2, release.set).start()
    state.restore()
    version = state._background._committed
    assert version.shared is shared_memory
    # Shared memory: no parameter has a copy of its own; each is rebuilt from the shards.
    assert sorted(version.covered) == (sorted(dict(model.named_parameters())) if shared_memory else [])
    assert not shared_memory or not any(name in version.model for name in version.covered)
    assert not optimizer._built  # laid out again, at the ranks of the next forward
    assert_same(plain(model, optimizer), committed)
    step(model, optimizer, data)
    assert optimizer._built
    assert_same(plain(model, optimizer), after_one)


def test_a_failed_capture_takes_the_objects_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture that fails leaves the commit before it, and restore() gives that commit's epoch too."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model, optimizer, epoch=0)
    data = torch.randn(3, 4)

    def train() -> None:
        optimizer.zero_grad()
        model(data).sum().backward()
        optimizer.step()

    train()
    state.epoch = 1
    state.commit()
    state.wait()
    weight = model.weight.detach().clone()
    train()
    state.epoch = 2

    def failing(*args: Any) -> list[int]:
        raise OSError("no memory for the copy")

    monkeypatch.setattr(checkpoint_capture, "_copy_plain", failing)
    state.commit()
    with pytest.warns(RuntimeWarning, match="was not captured"):
        state.restore()
    assert state.epoch == 1
    assert torch.equal(model.weight, weight)


def test_sigkill_with_shard_equals_a_run_started_from_the_commit(tmp_path: Path) -> None:
    """3 ranks over Gloo with shard=True; the rank launched as 1 (holding a shard of real elements)
    SIGKILLs itself after step() of step 3. The survivors rebuild its shard from the gathered commit,
    re-cut the state for 2 ranks and end with the parameters of a 2-rank run from that commit; the
    restored momentum and parameters follow from the committed samples' gradients, computed here."""
    out = tmp_path / "elastic"
    shard = {"ELASTIC_SHARD": "1", "COMMSCHED_TRANSPORT": "gloo"}
    # Its commit thread starts each capture 0.3 s late, as on a loaded host: its shard, copied before
    # its update, must count without that thread's wait for every rank's mark.
    done = launch(out, "-n", "3", "--min-np", "2", ELASTIC_KILL="1:0:3", ELASTIC_SLOW_COMMIT="1:0.3", **shard)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 (numbered as at launch" in done.stderr and "generation 1: 2 ranks" in done.stderr
    final = results(out)
    assert final["size"] == 2
    assert_every_sample_once(final)
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 3 * 2}
    assert "shard" not in restored["optimizer"]  # restored whole, per parameter
    # The rank script's loss is sum(w . x * t): each sample's gradient is t x whatever w is, and
    # SGD with momentum 1 keeps their sum, over every rank, in the momentum buffer.
    generator = torch.Generator().manual_seed(7)
    data = torch.randint(-3, 4, (SAMPLES, 4), generator=generator).double()
    target = torch.randint(-3, 4, (SAMPLES,), generator=generator).double()
    committed = restored["seen"][0]
    assert len(committed) == 18
    expected_momentum = (target[committed, None] * data[committed]).sum(0, keepdim=True)
    momentum = restored["optimizer"]["state"][0]["momentum_buffer"]
    assert torch.count_nonzero(momentum[0, 2:4]) == 2  # the lost rank's shard held real values
    assert torch.equal(momentum, expected_momentum)
    # The parameters come back from each rank's shard of them in shared memory, the lost rank's
    # included (its elements 2-3): w = -lr * (3 g0 + 2 g1 + g2) after three steps with momentum 1.
    steps = [committed[first : first + 6] for first in range(0, 18, 6)]
    gradients = [(target[batch, None] * data[batch]).sum(0, keepdim=True) for batch in steps]
    expected_weight = -0.125 * sum((3 - j) * gradient for j, gradient in enumerate(gradients))
    assert torch.count_nonzero(expected_weight[0, 2:4]) == 2
    assert torch.equal(restored["model"]["weight"], expected_weight)
    reference = launch(tmp_path / "reference", "-n", "2", ELASTIC_START=str(out / "restored.pt"), **shard)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = results(tmp_path / "reference")
    assert torch.equal(final["weight"], expected["weight"])
    assert final["seen"] == expected["seen"]


def test_sharded_kill_in_commit_goes_on_from_a_complete_commit(tmp_path: Path) -> None:
    """gRPC, shard=True: the rank launched as 1 dies as its commit's capture starts, so the others'
    gather of that commit fails; they restore a complete commit with its own sampler state, re-form
    at 2 ranks and see every sample once per epoch."""
    done = launch(
        tmp_path,
        *("-n", "3", "--min-np", "2", "--elastic-timeout", "3"),
        ELASTIC_KILL="1:1:1:commit",
        ELASTIC_SHARD="1",
        COMMSCHED_TRANSPORT="grpc",
        COMMSCHED_STALL_TIMEOUT="1",
        COMMSCHED_STALL_SHUTDOWN="3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 2 ranks" in done.stderr, done.stderr[-3000:]
    final = results(tmp_path)
    assert final["size"] == 2
    assert_every_sample_once(final)
