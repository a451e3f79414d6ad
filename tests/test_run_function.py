"""commsched.run(func, ...), Horovod's horovod.run: a function run on local ranks, results in rank order."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import commsched
from commsched import run_function
from commsched._horovod_util import get_env_rank_and_size


def rank_and_size(offset: int, scale: int = 1) -> tuple[int, int, int]:
    """What each rank returns: its launcher rank and size, and a value from the arguments."""
    rank, size = get_env_rank_and_size()
    print(f"rank {rank} speaking", flush=True)
    return rank, size, (offset + rank) * scale


def fails_on_rank_one() -> int:
    """Raises on rank 1 only."""
    rank, _ = get_env_rank_and_size()
    if rank == 1:
        raise ValueError("rank one cannot go on")
    return rank


def test_results_come_back_in_rank_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """args and kwargs reach every rank; a surrounding job's rank variables do not; output goes per rank."""
    monkeypatch.setenv("PMI_RANK", "5")  # as if the caller were itself rank 5 of 9 of an mpiexec job
    monkeypatch.setenv("PMI_SIZE", "9")
    results = commsched.run(
        rank_and_size, args=(10,), kwargs={"scale": 2}, num_proc=3, output_filename=str(tmp_path)
    )
    assert results == [(0, 3, 20), (1, 3, 22), (2, 3, 24)]
    assert (tmp_path / "rank.2" / "stdout").read_text() == "rank 2 speaking\n"


def test_an_elastic_run_with_hosts_or_a_discovery_script(tmp_path: Path) -> None:
    """Horovod's elastic arguments; a discovery script without a `#!` line runs through the shell."""
    assert commsched.run(
        rank_and_size, args=(0,), num_proc=2, min_num_proc=2, max_num_proc=2, hosts="localhost:2,127.0.0.1:2"
    ) == [
        (0, 2, 0),
        (1, 2, 1),
    ]
    script = tmp_path / "discover"
    script.write_text('echo "localhost:2"\n')
    script.chmod(0o700)
    results = commsched.run(
        rank_and_size, args=(1,), num_proc=2, min_num_proc=1, host_discovery_script=str(script)
    )
    assert results == [(0, 2, 1)]  # the first min_num_proc results, as Horovod returns


def test_a_rank_that_raises_fails_the_call_naming_it() -> None:
    """The exception of rank 1 comes back to the caller, with the rank."""
    with pytest.raises(RuntimeError, match="rank 1: ValueError: rank one cannot go on"):
        commsched.run(fails_on_rank_one, num_proc=2)


def test_under_mpiexec() -> None:
    """use_mpi=True starts the ranks with mpiexec."""
    from mpirun import mpiexec

    if mpiexec() is None:
        pytest.skip("needs mpiexec")
    assert commsched.run(rank_and_size, args=(0,), num_proc=2, use_mpi=True) == [(0, 2, 0), (1, 2, 1)]


def test_bad_arguments_are_refused_by_name(tmp_path: Path) -> None:
    """Other machines, too few slots, unsupported elastic knobs and bad sizes fail before anything starts."""
    with pytest.raises(ValueError, match="otherhost is another machine"):
        commsched.run(rank_and_size, args=(0,), num_proc=2, hosts="localhost:1,otherhost:4")
    with pytest.raises(ValueError, match="2 slots, fewer than num_proc=3"):
        commsched.run(rank_and_size, args=(0,), num_proc=3, hosts="localhost:2")
    with pytest.raises(NotImplementedError, match="reset_limit"):
        commsched.run(rank_and_size, args=(0,), num_proc=2, min_num_proc=1, reset_limit=3)
    with pytest.raises(ValueError, match="num_proc must be a number of ranks"):
        commsched.run(rank_and_size, num_proc=0)
    with pytest.raises(TypeError, match="needs a function"):
        commsched.run("train.py", num_proc=1)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2  # this machine\n127.0.0.1 slots=1\n")
    assert run_function._host_slots(None, str(hostfile), None) == {"localhost": 2, "127.0.0.1": 1}
    assert run_function._host_slots("localhost,127.0.0.1:3", None, 4) == {"localhost": 4, "127.0.0.1": 3}


def test_python_m_commsched_run_still_launches(tmp_path: Path) -> None:
    """commsched.run is callable and still the launcher module `python -m commsched.run` runs."""
    import subprocess
    import sys

    script = tmp_path / "rank.py"
    # One write per rank: print() writes its pieces apart, and the two ranks share the pipe.
    script.write_text("import os, sys; sys.stdout.write(f\"RANK {os.environ['RANK']}\\n\")\n")
    done = subprocess.run(
        [sys.executable, "-m", "commsched.run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "RANK", "WORLD_SIZE"))},
    )
    assert done.returncode == 0 and sorted(done.stdout.split("\n"))[1:] == ["RANK 0", "RANK 1"], done.stderr
    assert "RuntimeWarning" not in done.stderr, done.stderr
    assert callable(commsched.run) and commsched.run.main is not None
