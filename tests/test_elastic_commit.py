"""TorchState commits through the background capture: restore() gives exactly the committed values
while the capture still runs and after training changed the parameters, a failed capture leaves the
previous commit, and a commit with checkpoint_dir is loadable by a Checkpointer. One process."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import commsched.torch as cst
from commsched.torch import checkpoint_capture, elastic_commit, elastic_plan
from commsched.torch.elastic import TorchState

from commsched import _core


def build() -> tuple[Any, Any, Any]:
    """A model with a batch-norm buffer, Adam (tensor state, a tensor step) and one input."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    return model, optimizer, torch.randn(8, 16)


def step(model: Any, optimizer: Any, data: Any) -> None:
    optimizer.zero_grad()
    model(data).square().sum().backward()
    optimizer.step()


def snapshot(model: Any, optimizer: Any) -> tuple[dict[str, Any], dict[int, dict[str, Any]], list[Any]]:
    """Copies of the model's state, the optimizer's per-parameter state and its learning rates."""
    state = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in optimizer.state_dict()["state"].items()
    }
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        state,
        [g["lr"] for g in optimizer.param_groups],
    )


def assert_equal(got: Any, expected: Any) -> None:
    model, state, lrs = got
    assert model.keys() == expected[0].keys() and state.keys() == expected[1].keys()
    for name, tensor in model.items():
        assert torch.equal(tensor, expected[0][name]), name
    for index, values in state.items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(expected[1][index][name])), (
                index,
                name,
            )
    assert lrs == expected[2]


def test_restore_gives_the_commit_after_the_parameters_changed() -> None:
    """Steps, a changed learning rate and a new batch-norm statistic after commit() are all undone."""
    model, optimizer, data = build()
    state = TorchState(model, optimizer, epoch=0)
    step(model, optimizer, data)
    state.commit()
    committed = snapshot(model, optimizer)
    for _ in range(3):
        step(model, optimizer, data)
    optimizer.param_groups[0]["lr"] = 1.0
    state.epoch = 5
    assert not torch.equal(model[0].weight, committed[0]["0.weight"])
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)
    assert state.epoch == 0
    # And again from the same commit: restoring does not let training write into the commit.
    step(model, optimizer, data)
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)


def test_restore_while_the_capture_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps taken before the background thread copied anything copy each parameter first, on the
    training thread; restore() waits for the capture and gives exactly the committed values."""
    model, optimizer, data = build()
    state = TorchState(model, optimizer)
    step(model, optimizer, data)
    release = threading.Event()
    monkeypatch.setattr(elastic_commit, "lower_priority", lambda: release.wait(10))
    state.commit()
    committed = snapshot(model, optimizer)
    step(model, optimizer, data)
    step(model, optimizer, data)
    running = state._background._running
    assert running is not None and running[0].is_alive(), "the capture finished before the steps"
    assert running[1].inline_copies > 0
    threading.Timer(0.2, release.set).start()
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)


def test_a_failed_capture_leaves_the_previous_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that fails in the background is warned of; restore() goes back to the commit before."""
    model, optimizer, data = build()
    state = TorchState(model, optimizer)
    step(model, optimizer, data)
    state.commit()
    state.wait()
    committed = snapshot(model, optimizer)
    step(model, optimizer, data)
    original = checkpoint_capture._copy_plain

    def failing(destinations: list[Any], sources: list[Any], starts: Any = None) -> list[int]:
        if threading.current_thread() is not threading.main_thread():  # commit() copies buffers itself
            raise OSError("no memory for the copy")
        return original(destinations, sources, starts)

    monkeypatch.setattr(checkpoint_capture, "_copy_plain", failing)
    state.commit()
    with pytest.warns(RuntimeWarning, match="was not captured .*no memory for the copy"):
        state.wait()
    monkeypatch.setattr(checkpoint_capture, "_copy_plain", original)
    step(model, optimizer, data)
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)


@pytest.mark.parametrize("commits_before", [0, 2])
def test_a_commit_lost_in_its_collectives_keeps_objects_and_parameters_together(
    monkeypatch: pytest.MonkeyPatch, commits_before: int
) -> None:
    """A rank lost inside the model's commit (its collectives fail, as when the ranks of a host agree
    on commit numbers): restore() gives the last commit's parameters, sampler and plain objects
    together, whether that commit is the state's start or a later one."""
    from commsched.torch.elastic import ElasticSampler

    model, optimizer, data = build()
    sampler = ElasticSampler(list(range(12)), shuffle=False)
    state = TorchState(model, optimizer, sampler=sampler, seen=[])
    for batch in range(commits_before):
        step(model, optimizer, data)
        state.seen = [*state.seen, batch]
        sampler.record_batch(batch, 2)
        state.commit()
    state.wait()
    committed = snapshot(model, optimizer), sampler.state_dict(), list(state.seen)
    step(model, optimizer, data)
    state.seen = [*state.seen, commits_before]
    sampler.record_batch(commits_before, 2)

    def lost(*args: Any, **kwargs: Any) -> None:
        raise _core.RankFailure("a rank was lost in the commit's collective")

    monkeypatch.setattr(state._background, "commit", lost)
    with pytest.raises(_core.RankFailure):
        state.commit()
    monkeypatch.undo()
    state.restore()
    assert_equal(snapshot(model, optimizer), committed[0])
    assert (sampler.state_dict(), state.seen) == committed[1:]


def test_a_disk_commit_is_loadable(one_rank: None, tmp_path: Path) -> None:
    """With checkpoint_dir every commit is saved too; a Checkpointer loads the last into a fresh model."""
    model, optimizer, data = build()
    state = TorchState(model, optimizer, checkpoint_dir=tmp_path)
    for _ in range(2):
        step(model, optimizer, data)
        state.commit()
    committed = snapshot(model, optimizer)
    step(model, optimizer, data)
    state.restore()  # waits for the disk version too
    fresh_model, fresh_optimizer, _ = build()
    step(fresh_model, fresh_optimizer, data)  # Adam's state exists, so loading has something to replace
    checkpointer = cst.Checkpointer(fresh_model, fresh_optimizer, tmp_path)
    restored = checkpointer.load()
    checkpointer.close()
    assert restored is not None and restored.step == 3  # the commit at construction counts
    assert_equal(snapshot(fresh_model, fresh_optimizer), committed)


def test_checkpoint_dir_refuses_what_it_cannot_save(tmp_path: Path) -> None:
    """checkpoint_dir without a model and an optimizer, or not a path, names the fix."""
    with pytest.raises(ValueError, match="checkpoint_dir=.*needs model="):
        TorchState(checkpoint_dir=tmp_path)
    model, optimizer, _ = build()
    with pytest.raises(TypeError, match="checkpoint_dir=.*directory path"):
        TorchState(model, optimizer, checkpoint_dir=3)


def test_a_capture_with_nothing_to_copy_is_done_at_once() -> None:
    """A rank whose part of every cut tensor is empty (4 elements over 3 ranks: the third rank's) has
    nothing to copy: its commit is marked done at commit() time, not whenever the background thread
    first runs, so a rank killed one step later leaves that commit restorable."""
    marked: list[str] = []
    checkpoint_capture.Capture([]).when_done(lambda: marked.append("empty"))
    assert marked == ["empty"]
    source, destination = torch.arange(4.0), torch.zeros(4)
    copy = elastic_plan.copy_into("split.weight", lambda: source, destination)
    capture = checkpoint_capture.Capture([checkpoint_capture.Unit(None, [copy])])
    capture.when_done(lambda: marked.append("copied"))
    assert marked == ["empty"]
    capture.run()
    assert marked == ["empty", "copied"] and torch.equal(destination, source)


@pytest.fixture(params=["native", "python"])
def copy_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The capture's plain copies tested in C++ (commsched._torch_hooks) or in Python."""
    if request.param == "native":
        if checkpoint_capture._NATIVE is None:
            pytest.skip("commsched._torch_hooks is not built for this torch")
    else:
        monkeypatch.setattr(checkpoint_capture, "_NATIVE", None)
    return str(request.param)


def test_host_copies_land_whole_in_either_path(copy_path: str) -> None:
    """A capture's host copies go through the streaming copy (large, plain) or torch (a strided source,
    a lazily negated or conjugated view, another dtype), on the background thread and inline before an
    update alike; every element lands."""
    big = torch.randn(300_001)  # over the streaming threshold, not a whole number of cache lines
    strided = torch.randn(64, 2)[:, 0]
    complex_values = torch.randn(8, dtype=torch.complex64)
    sources = [big[1:], big[:5], strided, torch.randn(7)._neg_view(), complex_values.conj(), torch.arange(6)]
    destinations = [torch.empty_like(s.contiguous()) for s in sources]
    destinations[-1] = torch.empty(6, dtype=torch.float64)  # torch converts; the bytes would be wrong
    assert checkpoint_capture._copy_plain(destinations, sources) == [2, 3, 4, 5]
    checkpoint_capture._copy_on_host(destinations, sources)
    for source, destination in zip(sources, destinations, strict=True):
        assert torch.equal(source.to(destination.dtype), destination)
    param = torch.nn.Parameter(torch.randn(200_003))
    destination = torch.zeros(200_003)
    copy = elastic_plan.copy_into("weight", lambda: param, destination)
    capture = checkpoint_capture.Capture([checkpoint_capture.Unit(param, [copy])])
    capture.before_update([param])  # copied inline, as when the background thread has not reached it
    assert torch.equal(destination, param.detach()) and capture.inline_copies == 1
    with pytest.raises(ValueError, match="null address"):
        _core.copy_bypassing_cache([(0, big.data_ptr(), 8)])


def test_a_cut_copies_its_range_of_elements_in_either_path(copy_path: str) -> None:
    """A rank's part of a cut tensor is a range of its flattened elements, taken straight from the
    tensor (no view built) where it is dense, through a view where it is not (a transposed weight);
    a tensor that shrank below its range fails the capture with its name."""
    weight = torch.randn(70_000, 3)  # over the streaming threshold
    transposed = torch.randn(5, 8).t()
    shrinking = torch.nn.Parameter(torch.randn(10))
    destinations = [torch.zeros(100_001), torch.zeros(17), torch.zeros(4)]
    copies = [
        elastic_plan.copy_into("split.w", lambda: weight, destinations[0], flat=(50_000, 100_001)),
        elastic_plan.copy_into("split.t", lambda: transposed, destinations[1], flat=(3, 17)),
        elastic_plan.copy_into("split.s", lambda: shrinking, destinations[2], flat=(6, 4)),
    ]
    checkpoint_capture.Capture([checkpoint_capture.Unit(None, copies)]).run()
    assert torch.equal(destinations[0], weight.reshape(-1)[50_000:150_001])
    assert torch.equal(destinations[1], transposed.reshape(-1)[3:20])
    assert torch.equal(destinations[2], shrinking.detach()[6:])
    shrinking.data = torch.randn(8)
    capture = checkpoint_capture.Capture([checkpoint_capture.Unit(None, copies[2:])])
    with pytest.raises(
        RuntimeError, match=r"'split.s' changed from torch.float32 \[4\] to torch.float32 \[2\]"
    ):
        capture.run()
    with pytest.raises(ValueError, match="'split.w': a flat range of 5 elements .* not into 100001 elements"):
        elastic_plan.copy_into("split.w", lambda: weight, destinations[0], flat=(0, 5))


def test_a_source_that_changed_shape_is_named_in_either_path(copy_path: str) -> None:
    """A tensor reshaped between commit() and its capture (against the rules) fails the capture with
    its name and both shapes, whichever path tests the copy."""
    param = torch.nn.Parameter(torch.randn(4, 3))
    beside = torch.randn(5)
    destinations = [torch.zeros(4, 3), torch.zeros(5)]
    copies = [
        elastic_plan.copy_into("layer.weight", lambda: param, destinations[0]),
        elastic_plan.copy_into("layer.bias", lambda: beside, destinations[1]),
    ]
    capture = checkpoint_capture.Capture([checkpoint_capture.Unit(None, copies)])
    param.data = torch.randn(3, 4)
    with pytest.raises(
        RuntimeError, match=r"'layer.weight' changed from torch.float32 \[4, 3\] to .*\[3, 4\]"
    ):
        capture.run()


class _Counting(torch.optim.SGD):
    """SGD that also keeps a plain int per parameter in its state, as some optimizers keep their step."""

    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                self.state[param]["count"] = self.state[param].get("count", 0) + 1
        return super().step(closure)


def test_the_copies_are_planned_once_while_the_tensors_stay_the_same() -> None:
    """Commits into either buffer reuse their plan; the int state and learning rate are still copied at
    each commit, so a restore gives the values of the last commit, not of the first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    optimizer = _Counting(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.randn(8, 16)
    state = TorchState(model, optimizer, epoch=0)
    step(model, optimizer, data)
    state.commit()
    state.commit()  # each buffer has a plan now
    background = state._background
    background.wait()
    plans = {id(background._spare.plan), id(background._committed.plan)}
    for lr in (0.04, 0.03, 0.02):
        step(model, optimizer, data)
        optimizer.param_groups[0]["lr"] = lr
        state.commit()
    background.wait()
    assert {id(background._spare.plan), id(background._committed.plan)} == plans, "planned again"
    committed = snapshot(model, optimizer)
    assert committed[1][0]["count"] == 4 and committed[2] == [0.02]
    step(model, optimizer, data)
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)


def test_new_state_tensors_are_planned_again() -> None:
    """After optimizer.load_state_dict with new state tensors the next commit plans its copies again
    and restore() gives exactly what it committed."""
    model, optimizer, data = build()
    state = TorchState(model, optimizer, epoch=0)
    step(model, optimizer, data)
    state.commit()
    state.commit()
    state.wait()  # changes outside step() come after the capture, as TorchState documents
    background = state._background
    before = {id(background._spare.plan), id(background._committed.plan)}
    # A copy: loading the optimizer's own state_dict would keep its tensors.
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    step(model, optimizer, data)
    state.commit()
    state.wait()
    assert id(background._committed.plan) not in before, "the plan outlived the state tensors it was made for"
    committed = snapshot(model, optimizer)
    step(model, optimizer, data)
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)


def test_a_parameter_given_a_new_dtype_is_planned_again() -> None:
    """Module.double() keeps every parameter and changes its dtype (no buffers, and SGD without momentum:
    no other tensor changes with it): the next commit plans again and restore() gives the float64 values."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    data = torch.randn(8, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    state = TorchState(model, optimizer, epoch=0)
    step(model, optimizer, data)
    state.commit()
    state.wait()  # changes outside step() come after the capture, as TorchState documents
    model.double()
    data = data.double()
    step(model, optimizer, data)
    state.commit()
    state.commit()
    committed = snapshot(model, optimizer)
    assert all(t.dtype == torch.float64 for t in committed[0].values() if t.is_floating_point())
    step(model, optimizer, data)
    state.restore()
    assert_equal(snapshot(model, optimizer), committed)
