"""Checks written the way Horovod's tests are (`import horovod.torch as hvd`), run by
scripts/horovod_suite.py on every rank; each compares against a reference computed another way."""

from __future__ import annotations

import json
import os
import tempfile
import time
import warnings
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.runner.util.threads import in_thread


def _rank_file(path: Path) -> Path:
    """Where this rank's trace lands: ranks above 0 add .rank<N> before the extension."""
    return path if hvd.rank() == 0 else path.with_name(f"{path.stem}.rank{hvd.rank()}{path.suffix}")


def test_allreduce_sum_matches_every_rank_inputs() -> None:
    hvd.init()
    inputs = [torch.arange(12, dtype=torch.float64).reshape(3, 4) * (r + 1) for r in range(hvd.size())]
    reduced = hvd.allreduce(inputs[hvd.rank()], op=hvd.Sum, name="suite.sum")
    assert torch.equal(reduced, sum(inputs))


def test_start_stop_timeline_moves_and_ends_the_trace() -> None:
    hvd.init()
    folder = Path(tempfile.mkdtemp())
    first, second = folder / "first.json", folder / "second.json"
    hvd.start_timeline(str(first), mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="timeline_probe")
    time.sleep(0.2)  # a few rounds of the core, each marked
    hvd.start_timeline(str(second), mark_cycles=False)  # moves the trace: the first file ends here
    hvd.allreduce(torch.ones(3), name="timeline_second")
    hvd.stop_timeline()
    hvd.stop_timeline()  # a second stop does nothing
    first_events = json.loads(_rank_file(first).read_text())
    second_events = json.loads(_rank_file(second).read_text())
    first_text, second_text = json.dumps(first_events), json.dumps(second_events)
    assert "allreduce.timeline_probe" in first_text and "allreduce.timeline_second" not in first_text
    assert "allreduce.timeline_second" in second_text and "allreduce.timeline_probe" not in second_text
    assert any(e.get("name") == "CYCLE_START" for e in first_events)
    assert not any(e.get("name") == "CYCLE_START" for e in second_events)
    assert any("start_time_since_epoch_in_micros" in e.get("args", {}) for e in first_events)
    size_after_stop = _rank_file(second).stat().st_size
    hvd.allreduce(torch.ones(3), name="timeline_after_stop")
    assert _rank_file(second).stat().st_size == size_after_stop


def test_nccl_built_is_a_version_number() -> None:
    try:
        from commsched import _nccl
        from commsched.transports import nccl

        expected = int(_nccl.version(nccl.load_api()))
    except (ImportError, RuntimeError):
        expected = 0
    assert hvd.nccl_built() == expected
    assert isinstance(hvd.nccl_built(), int)


def test_step_after_synchronize_warns_in_horovods_words() -> None:
    hvd.init()
    model = torch.nn.Linear(2, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(1, 2)).sum().backward()
    optimizer.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    assert any(
        "optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in caught
    )


def test_in_thread_runs_the_target() -> None:
    seen = []
    thread = in_thread(target=seen.append, args=(os.getpid(),))
    thread.join(10)
    assert seen == [os.getpid()] and thread.daemon
