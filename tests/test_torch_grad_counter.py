"""The gradient counter behind commsched.torch's buckets: C++ (commsched._torch_hooks) and Python alike."""

from __future__ import annotations

import gc
import importlib.util
import weakref
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from commsched.torch import _counter

COUNTERS = ["native", "python"]


def _make(kind: str, slots: int, passes: int, on_event: Any) -> Any:
    if kind == "native":
        return _counter.native().GradCounter(slots, passes, on_event)
    return _counter.PythonGradCounter(slots, passes, on_event)


def _model() -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _backward(model: Any) -> None:
    model(torch.ones(2, 4)).sum().backward()


@pytest.fixture(params=COUNTERS)
def kind(request: pytest.FixtureRequest) -> str:
    """Each counter in turn; the native one only where commsched._torch_hooks is built."""
    if request.param == "native" and not _counter.is_native():
        pytest.skip("commsched._torch_hooks not built")
    return str(request.param)


def _hooked(kind: str, passes: int, on_event: Any) -> tuple[Any, Any]:
    """A fresh model and a counter of `kind` hooked on each of its parameters (slot i: parameter i)."""
    model = _model()
    params = list(model.parameters())
    counter = _make(kind, len(params), passes, on_event)
    for index, param in enumerate(params):
        counter.hook(param, index)
    return model, counter


def test_the_native_counter_is_built_wherever_native_gloo_is() -> None:
    """Both are built against the same torch headers: one without the other is a broken build."""
    if importlib.util.find_spec("commsched._gloo") is None:
        pytest.skip("commsched was built without torch's C++ side")
    assert _counter.is_native()


def test_a_bucket_is_reported_once_when_its_last_member_arrives(kind: str) -> None:
    """Members only count down; the last one's event names the bucket; unbucketed ones report each."""
    events: list[tuple[int, int, int]] = []
    model, counter = _hooked(kind, 1, lambda *e: events.append(e))
    # Slots 0 and 1 (the first layer) share bucket 0, slot 3 has bucket 1, slot 2 none.
    counter.set_buckets([0, 0, -1, 1], [2, 1])
    assert not counter.opened()
    _backward(model)
    assert counter.opened()
    full = sorted(e for e in events if e[0] == _counter.BUCKET_FULL)
    assert [e[2] for e in full] == [0, 1]  # each bucket once, after all of its members
    assert [e for e in events if e[0] == _counter.UNBUCKETED] == [(_counter.UNBUCKETED, 2, -1)]
    assert counter.take_passes() == [1, 1, 1, 1]
    assert counter.take_passes() == [0, 0, 0, 0]
    assert counter.take_used([0, 1, 3]) == [True, True, True]
    assert counter.take_used([0, 1, 3]) == [False, False, False]
    counter.mark_closed()
    assert not counter.opened()


def test_flying_members_report_again_and_reset_buckets_count_anew(kind: str) -> None:
    """A gradient ready while its bucket is on the wire is an AGAIN event; after reset it counts again."""
    events: list[tuple[int, int, int]] = []
    model, counter = _hooked(kind, 1, lambda *e: events.append(e))
    counter.set_buckets([0, 0, 0, 0], [4])
    _backward(model)
    assert [e[0] for e in events] == [_counter.BUCKET_FULL]
    counter.take_passes()
    counter.set_flying([0, 1, 2, 3], True)
    events.clear()
    _backward(model)
    assert sorted(e[1] for e in events) == [0, 1, 2, 3]
    assert {e[0] for e in events} == {_counter.AGAIN}
    counter.take_passes()
    counter.set_flying([0, 1, 2, 3], False)
    counter.reset_bucket(0)
    events.clear()
    _backward(model)
    assert [e[0] for e in events] == [_counter.BUCKET_FULL]


def test_passes_per_step_counts_before_reporting(kind: str) -> None:
    """With 2 passes per step a member counts down on its second pass, not its first or third."""
    events: list[tuple[int, int, int]] = []
    model, counter = _hooked(kind, 2, lambda *e: events.append(e))
    counter.set_buckets([0, 0, 0, 0], [4])
    _backward(model)
    assert events == []
    _backward(model)
    assert [e[0] for e in events] == [_counter.BUCKET_FULL]
    _backward(model)  # a third pass accumulates into the same, unsent bucket
    assert len(events) == 1
    assert counter.take_passes() == [3, 3, 3, 3]


def test_unhooked_slots_are_not_counted_and_bad_layouts_are_refused(kind: str) -> None:
    """unhook stops the count; a layout of the wrong length or with an unknown bucket is an error."""
    events: list[tuple[int, int, int]] = []
    model, counter = _hooked(kind, 1, lambda *e: events.append(e))
    assert counter.hooked(0)
    counter.unhook(0)
    assert not counter.hooked(0)
    _backward(model)
    assert counter.take_passes() == [0, 1, 1, 1]
    counter.unhook_all()
    _backward(model)
    assert counter.take_passes() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        counter.set_buckets([0, 0], [2])
    with pytest.raises(ValueError):
        counter.set_buckets([0, 0, 0, 5], [4])


def test_an_error_raised_for_an_event_fails_the_backward_pass(kind: str) -> None:
    """What Python raises on an event (a gradient ready again) reaches the caller of backward()."""

    def refuse(kind_: int, slot: int, bucket: int) -> None:
        raise RuntimeError(f"gradient of slot {slot} became ready again")

    model, _counter = _hooked(kind, 1, refuse)  # held: a dropped counter's hooks call nothing
    with pytest.raises(RuntimeError, match="became ready again"):
        _backward(model)


def test_the_optimizer_trains_alike_on_both_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank, buckets on from the second step: the same parameters whichever counter runs, and a
    dropped optimizer's hooks call nothing."""
    import commsched.torch as ct

    import commsched

    commsched.init(transport="loopback")
    try:
        results = []
        for native in (True, False):
            if not native:
                monkeypatch.setattr(_counter, "native", lambda: None)
            elif not _counter.is_native():
                continue
            model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
            torch.manual_seed(1)
            for p in model.parameters():
                torch.nn.init.uniform_(p, -0.3, 0.3)
            opt = ct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
            for step in range(4):
                opt.zero_grad()
                model(torch.full((2, 8), 0.1 * (step + 1))).square().mean().backward()
                opt.step()
            assert opt.buckets(), "buckets are built after the first step"
            results.append([p.detach().clone() for p in model.parameters()])
            assert all(bool(torch.isfinite(p).all()) for p in results[-1])
            reducer = weakref.ref(opt._reducer)
            del opt
            gc.collect()
            assert reducer() is None, "a dropped optimizer's hooks keep its reducer alive"
            _backward_ok = model(torch.ones(2, 8)).sum()
            _backward_ok.backward()  # the dropped optimizer's counter must not fire into it
        if len(results) == 2:
            for a, b in zip(*results):
                assert torch.equal(a, b)
    finally:
        commsched.shutdown()
