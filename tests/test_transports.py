"""One multi-rank suite over every transport on this machine (MPI, gRPC, Gloo), same expectations;
plus the transport selection rules and the launcher's job token."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import local_launch  # tests/ is on sys.path (conftest.py)

from commsched import transports
from commsched.launch import LaunchInfo

ROOT = Path(__file__).resolve().parent.parent
RANDOM = ROOT / "tests" / "ranks" / "random_collectives.py"
# Small enough for a 2-core machine, and still: partitioned, fused and credit-gated launches
# (config 1) and FIFO with fusion (config 4), every dtype, random order, broadcast and average.
SUITE_ARGS = ["--tensors", "100", "--configs", "1,4", "--seed", "5"]


MPIEXEC = Path(sys.executable).parent / "mpiexec"  # the venv's mpich, even when the venv is not activated
if not MPIEXEC.exists():
    MPIEXEC = Path(shutil.which("mpiexec") or "/nonexistent")


def _mpi_available() -> bool:
    return importlib.util.find_spec("commsched._mpi") is not None and MPIEXEC.exists()


TRANSPORTS = {
    "mpi": _mpi_available(),
    "grpc": importlib.util.find_spec("grpc") is not None,
    "gloo": importlib.util.find_spec("torch") is not None,
}


def launch_command(transport: str, ranks: int, script: Path, arguments: list[str]) -> list[str]:
    """How a transport's ranks are started: mpiexec for MPI, commsched's launcher (torchrun-style) otherwise."""
    if transport == "mpi":
        return [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "mpi4py", str(script), *arguments]
    return local_launch(ranks, str(script), *arguments)


def rank_environment() -> dict[str, str]:
    """The test's environment without launcher variables a surrounding job may have set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMSCHED_", "PMI_", "OMPI_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_random_collectives_over_transport(transport: str, ranks: int) -> None:
    """The core's randomized correctness program passes on every rank over this transport."""
    if not TRANSPORTS[transport]:
        pytest.skip(f"{transport} is not available here")
    command = launch_command(transport, ranks, RANDOM, [*SUITE_ARGS, "--transport", transport])
    done = subprocess.run(
        command, check=False, env=rank_environment(), capture_output=True, text=True, timeout=240
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    for rank in range(ranks):
        # one line per configuration, each run with the transport asked for
        assert output.count(f"rank {rank}: OK") == 2, output
        assert output.count(f"'transport': '{transport}'") >= 2 * ranks, output


def _info(launcher: str, size: int) -> LaunchInfo:
    return LaunchInfo(launcher, 0, size, 0, "127.0.0.1" if launcher == "torchrun" else "", 29500)


@pytest.mark.parametrize(
    ("launcher", "size", "torch", "cuda", "expected"),
    [
        ("mpiexec", 4, True, False, "mpi"),
        ("torchrun", 4, True, False, "gloo"),
        ("torchrun", 4, False, False, "grpc"),
        ("single", 1, True, False, "loopback"),
        ("torchrun", 4, True, True, "nccl"),
        ("mpiexec", 4, False, True, "nccl"),
    ],
)
def test_auto_rules(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    launcher: str,
    size: int,
    torch: bool,
    cuda: bool,
    expected: str,
) -> None:
    """auto: NCCL for CUDA buffers, MPI under mpiexec, Gloo with PyTorch, else gRPC; logged at info."""
    monkeypatch.setattr(transports, "_torch_present", lambda: torch)
    with caplog.at_level("INFO", logger="commsched"):
        assert transports.choose("auto", _info(launcher, size), None, None, cuda_buffers=cuda) == expected
    assert f"COMMSCHED_TRANSPORT=auto chose {expected}" in caplog.text


def test_explicit_choice_is_kept() -> None:
    """An explicit transport is used as asked, whatever the launcher."""
    assert transports.choose("grpc", _info("torchrun", 3), None, None) == "grpc"
    assert transports.choose("gloo", _info("torchrun", 3), None, None) == "gloo"


def test_grpc_needs_rendezvous_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without MASTER_ADDR/MASTER_PORT or a peer list the error says what to set."""
    pytest.importorskip("grpc")
    monkeypatch.delenv("COMMSCHED_GRPC_PEERS", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        transports.build("grpc", LaunchInfo("torchrun", 0, 2, 0), None, None)


def test_launcher_passes_one_fresh_token(tmp_path: Path) -> None:
    """python -m commsched.run gives every rank the same generated COMMSCHED_JOB_TOKEN and its RANK."""
    script = tmp_path / "show.py"
    script.write_text(
        "import os, pathlib\n"
        "pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text("
        "os.environ['COMMSCHED_JOB_TOKEN'] + ' ' + os.environ['WORLD_SIZE'] + ' ' + os.environ['MASTER_PORT'])\n"
    )
    tokens = []
    for _ in range(2):
        env = dict(rank_environment(), OUT=str(tmp_path))
        subprocess.run(
            local_launch(3, str(script)),
            env=env,
            check=True,
            timeout=60,
        )
        seen = [(tmp_path / str(rank)).read_text().split() for rank in range(3)]
        assert len({tuple(s) for s in seen}) == 1, seen
        token, size, port = seen[0]
        assert size == "3" and int(port) > 0
        assert len(token) == 32 and int(token, 16) >= 0
        tokens.append(token)
    assert tokens[0] != tokens[1]  # fresh per job


def test_launcher_keeps_a_given_token(tmp_path: Path) -> None:
    """A COMMSCHED_JOB_TOKEN set by the user is passed on unchanged."""
    script = tmp_path / "show.py"
    script.write_text(
        "import os, pathlib\npathlib.Path(os.environ['OUT']).write_text(os.environ['COMMSCHED_JOB_TOKEN'])\n"
    )
    env = dict(rank_environment(), OUT=str(tmp_path / "token"), COMMSCHED_JOB_TOKEN="given-token-123")
    subprocess.run(
        local_launch(1, str(script)),
        env=env,
        check=True,
        timeout=60,
    )
    assert (tmp_path / "token").read_text() == "given-token-123"


def test_cpu_shares_cut_the_cpus_into_equal_consecutive_shares() -> None:
    """--bind-to core: equal consecutive shares, the remainder unused; more ranks than CPUs share in turn."""
    from commsched.run import cpu_shares

    assert cpu_shares([0, 1], 2) == [{0}, {1}]
    assert cpu_shares([0, 1, 2, 3, 4, 5, 6], 3) == [{0, 1}, {2, 3}, {4, 5}]
    assert cpu_shares([4, 5, 6, 7], 1) == [{4, 5, 6, 7}]
    assert cpu_shares([0, 1], 5) == [{0}, {1}, {0}, {1}, {0}]
    with pytest.raises(ValueError, match="no CPUs"):
        cpu_shares([], 2)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
def test_launcher_binds_each_rank_to_its_own_cpus(tmp_path: Path) -> None:
    """commsched-run --bind-to core: every rank runs on its own share of the launcher's CPUs, and the
    threads it starts inherit it; without the flag each rank keeps every CPU the launcher had."""
    from commsched.run import cpu_shares

    script = tmp_path / "show.py"
    script.write_text(
        "import os, pathlib, threading\n"
        "seen = []\n"
        "worker = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0))))\n"
        "worker.start(); worker.join()\n"
        "pathlib.Path(os.environ['OUT'], os.environ['RANK']).write_text(' '.join(map(str, seen[0])))\n"
    )
    mine = sorted(os.sched_getaffinity(0))
    for binding, expected in (("core", cpu_shares(mine, 2)), ("none", [set(mine)] * 2)):
        argv = local_launch(2, str(script))
        argv[argv.index("-n") : argv.index("-n")] = ["--bind-to", binding]
        subprocess.run(argv, env=dict(rank_environment(), OUT=str(tmp_path)), check=True, timeout=60)
        seen = [{int(cpu) for cpu in (tmp_path / str(rank)).read_text().split()} for rank in range(2)]
        assert seen == expected, (binding, seen)
    refused = subprocess.run(
        [sys.executable, "-m", "commsched.run", "--bind-to", "socket", "-n", "1", str(script)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--bind-to" in refused.stderr and "core" in refused.stderr
