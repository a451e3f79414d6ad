"""Bad input refused up front, naming the thing and the fix: commsched-run's numbers and program, the
Python Gloo transport's completion relays. Each case runs in this process, in well under a second."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from commsched import run


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--grace", "nan"], "--grace"),
        (["--grace", "inf"], "--grace"),
        (["--master-port", "70000"], "--master-port"),
        (["--master-port", "-5"], "--master-port"),
        (["--min-np", "1", "--elastic-timeout", "nan"], "--elastic-timeout"),
    ],
)
def test_launcher_refuses_numbers_it_would_hang_or_fail_on(
    arguments: list[str], named: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A grace or elastic timeout of nan/inf (the job would wait forever) or a port out of range is
    refused before any rank starts, naming the flag and its accepted form."""
    program = tmp_path / "train.py"
    program.write_text("raise SystemExit(9)\n")  # run, it would fail with 9, not 2
    with pytest.raises(SystemExit) as ended:
        run.main(["-n", "2", *arguments, str(program)])
    assert ended.value.code == 2
    error = capsys.readouterr().err
    assert named in error and arguments[-1] in error, error


def test_launcher_refuses_a_missing_program(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A script that is not there is named once by the launcher, not once per rank by Python."""
    missing = tmp_path / "tain.py"
    with pytest.raises(SystemExit) as ended:
        run.main(["-n", "2", str(missing)])
    assert ended.value.code == 2
    error = capsys.readouterr().err
    assert f"{missing}: no such file" in error and "-m MODULE" in error, error


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_gloo_relay_runs_the_callback_once_whether_released_or_completed() -> None:
    """A stuck collective's relay released at close() runs its callback at once; the collective's own
    completion afterwards runs nothing more and raises nothing (it is C++ alone that completes the relay)."""
    import threading

    import torch

    from commsched.transports.gloo import GlooTransport

    transport = GlooTransport.__new__(GlooTransport)  # only the callback bookkeeping, no process group
    transport._torch = torch
    transport._callbacks = threading.Condition()
    transport._callbacks_running = transport._callbacks_begun = 0
    transport._relays, transport._relay_count = {}, 0
    calls: list[str] = []
    stuck, finished = torch.futures.Future(), torch.futures.Future()
    transport.run_on_completion(stuck, lambda: calls.append("stuck"))
    transport.run_on_completion(finished, lambda: calls.append("finished"))
    finished.set_result(None)
    assert calls == ["finished"] and len(transport._relays) == 1
    transport._release_relays()
    assert calls == ["finished", "stuck"] and not transport._relays
    stuck.set_exception(RuntimeError("the peer is gone"))  # as Gloo fails it later
    assert calls == ["finished", "stuck"]
    assert transport._callbacks_running == 0


def _model(width: int) -> tuple[Any, Any]:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_checkpoint_of_another_model_is_refused_before_anything_is_restored(tmp_path: Path) -> None:
    """A version saved from a wider model names the parameter and both shapes, and leaves the optimizer
    as it was (it used to take the other model's state before the model's own load refused it)."""
    import commsched.torch as ct
    import torch

    saved, optimizer = _model(8)
    saved(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    checkpointer = ct.Checkpointer(saved, optimizer, tmp_path)
    checkpointer.save(0)
    checkpointer.close()
    other, other_optimizer = _model(16)
    loader = ct.Checkpointer(other, other_optimizer, tmp_path)
    with pytest.raises(
        ValueError, match=r"saved from another model \('0\.weight' is \[8, 4\] there, \[16, 4\] here"
    ):
        loader.load()
    loader.close()
    assert other_optimizer.state_dict()["state"] == {}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_checkpoint_directory_that_is_a_file_is_named(tmp_path: Path) -> None:
    """A directory path that names a file is refused naming the path and where to set another."""
    import commsched.torch as ct

    taken = tmp_path / "checkpoints"
    taken.write_text("not a directory")
    model, optimizer = _model(8)
    with pytest.raises(OSError, match=rf"cannot use {taken} as its directory .*COMMSCHED_CHECKPOINT_DIR"):
        ct.Checkpointer(model, optimizer, taken)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_init_refuses_a_duration_that_is_not_finite(value: float) -> None:
    """init(stall_timeout=nan) would disable every stall limit it is compared against: refused by name."""
    import commsched
    from commsched.config import SettingError

    with pytest.raises(SettingError, match=r"stall_timeout.*not a finite number.*e\.g\. 60"):
        commsched.init(stall_timeout=value)
    assert not commsched.is_initialized()


def test_a_wait_of_nan_seconds_is_refused_not_endless() -> None:
    """A handle's or a group's wait(nan) compared false against every clock reading and never ended."""
    import numpy as np

    import commsched

    commsched.init()
    try:
        handle = commsched.allreduce_async(np.ones(4, np.float32), name="nan.wait")
        with pytest.raises(ValueError, match=r"'nan.wait': timeout is nan; pass seconds"):
            handle.wait(float("nan"))
        assert handle.wait(5.0).tolist() == [1.0] * 4
        group = commsched.grouped_allreduce_async([np.ones(2, np.float32)], name="nan.group")
        with pytest.raises(ValueError, match=r"a group of 1.*timeout is nan"):
            group.wait(float("nan"))
        assert group.wait(5.0)[0].tolist() == [1.0, 1.0]
    finally:
        commsched.shutdown()
