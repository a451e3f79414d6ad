"""Bad input refused up front, naming the thing and the fix: commsched-run's numbers and program, the
Python Gloo transport's completion relays. Each case runs in this process, in well under a second."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
