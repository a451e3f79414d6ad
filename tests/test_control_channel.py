"""The TCP control channel at 2 and 3 ranks over MPI, native Gloo and gRPC: collectives stay exact while every
agreement round travels over it; `auto` on one host keeps MPI's shared-memory exchange and takes the
channel for the others; bad settings
are refused with the variable named. (The channel's own protocol is tested in tests/cpp.)"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from mpirun import clean_rank_env, local_launch, run_ranks, unglue  # tests/ is on sys.path (conftest.py)

from commsched.config import SettingError, resolve

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "tests" / "ranks" / "control_channel.py"
# Small partitions, so the largest tensors go out as several chunks under the credit gate.
SIZES = {"COMMSCHED_PARTITION_BYTES": "256KiB", "COMMSCHED_CREDIT_BYTES": "512KiB"}

needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or importlib.util.find_spec("commsched._mpi") is None,
    reason="needs mpi4py and commsched's MPI transport",
)
needs_gloo = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None or importlib.util.find_spec("commsched._gloo") is None,
    reason="needs PyTorch and commsched's native Gloo transport",
)


def _ok_lines(output: str, ranks: int, channel: str, one_host: bool = True) -> None:
    """Every rank printed OK with its rounds over `channel`; over the channel on one host, critical rounds
    spun exactly when every rank has a CPU of its own (ControlPath::spins_on_critical_rounds)."""
    output = unglue(output, "rank ")
    for rank in range(ranks):
        assert f"rank {rank}: OK" in output and f"rounds over {channel}" in output, output
    spun = [int(n) for n in re.findall(r"rank \d+: OK .*?, (\d+) spun", output)]
    assert len(spun) == ranks, output
    if channel == "tcp" and one_host and ranks <= (os.cpu_count() or 1):
        assert all(n > 0 for n in spun), output
    else:
        assert all(n == 0 for n in spun), output


def _launch(ranks: int, env: dict[str, str], expect: str) -> subprocess.CompletedProcess[str]:
    """The rank program under commsched's own launcher, expecting `expect`."""
    return subprocess.run(
        local_launch(ranks, str(PROGRAM), "--expect", expect),
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_mpi_collectives_are_exact_with_every_round_over_the_tcp_channel(ranks: int) -> None:
    """COMMSCHED_CONTROL_CHANNEL=tcp under mpiexec: results equal numpy and stats count every round on the channel."""
    result = run_ranks(
        ranks, PROGRAM.name, "--expect", "tcp", env={**SIZES, "COMMSCHED_CONTROL_CHANNEL": "tcp"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _ok_lines(result.stdout, ranks, "tcp")


needs_grpc = pytest.mark.skipif(importlib.util.find_spec("grpc") is None, reason="needs grpcio")


@pytest.mark.parametrize(
    ("transport", "ranks"),
    [
        pytest.param("gloo", 2, marks=needs_gloo),
        pytest.param("gloo", 3, marks=needs_gloo),
        pytest.param("grpc", 2, marks=needs_grpc),
    ],
)
def test_launcher_collectives_are_exact_with_every_round_over_the_tcp_channel(
    transport: str, ranks: int
) -> None:
    """The same over native Gloo and over gRPC (a Python transport), started by commsched's own launcher."""
    env = {
        **clean_rank_env(ROOT),
        **SIZES,
        "COMMSCHED_TRANSPORT": transport,
        "COMMSCHED_CONTROL_CHANNEL": "tcp",
    }
    result = _launch(ranks, env, "tcp")
    assert result.returncode == 0, result.stdout + result.stderr
    _ok_lines(result.stdout, ranks, "tcp")
    assert f"over {transport}" in result.stdout


@needs_gloo
def test_a_departed_peer_is_named_by_every_other_rank() -> None:
    """Rank 1 of 3 exits mid-job: ranks 0 and 2 fail with RankFailure.rank == 1 from the channel, no hang."""
    env = {**clean_rank_env(ROOT), "COMMSCHED_TRANSPORT": "gloo", "COMMSCHED_CONTROL_CHANNEL": "tcp"}
    result = _launch(3, env, "peer-exits")
    output = unglue(result.stdout + result.stderr, "PEER-EXIT-OK")
    for rank in (0, 2):
        assert f"PEER-EXIT-OK on rank {rank}," in output, output


@needs_mpi
def test_auto_on_one_host_keeps_the_transport_exchange() -> None:
    """Ranks sharing one network stack: auto leaves the rounds on MPI's shared memory (no channel round)."""
    result = run_ranks(
        2, PROGRAM.name, "--expect", "transport", env={**SIZES, "COMMSCHED_CONTROL_CHANNEL": "auto"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _ok_lines(result.stdout, 2, "transport")


@pytest.mark.parametrize(
    "transport", [pytest.param("grpc", marks=needs_grpc), pytest.param("gloo", marks=needs_gloo)]
)
def test_auto_on_one_host_takes_the_channel_outside_mpi(transport: str) -> None:
    """gRPC (exchange through Python) and native Gloo (pair sockets and worker threads) spend hundreds
    of microseconds a round on one host: auto takes the channel there too, and results stay exact."""
    env = {
        **clean_rank_env(ROOT),
        **SIZES,
        "COMMSCHED_TRANSPORT": transport,
        "COMMSCHED_CONTROL_CHANNEL": "auto",
    }
    result = _launch(2, env, "tcp")
    assert result.returncode == 0, result.stdout + result.stderr
    _ok_lines(result.stdout, 2, "tcp")


def test_a_bad_channel_value_names_the_variable_and_the_choices() -> None:
    """COMMSCHED_CONTROL_CHANNEL=udp is refused at init with the variable and the accepted values."""
    with pytest.raises(SettingError, match=r"COMMSCHED_CONTROL_CHANNEL.*'udp'.*one of auto, tcp, transport"):
        resolve({}, {"COMMSCHED_CONTROL_CHANNEL": "udp"})
    assert resolve({}, {"COMMSCHED_CONTROL_CHANNEL": " TCP "}).control_channel == "tcp"
    assert resolve({}, {}).control_channel == "auto"


@needs_mpi
def test_an_address_this_host_lacks_fails_every_rank_with_the_variable_named() -> None:
    """COMMSCHED_CONTROL_ADDRESS naming no interface: init() fails on every rank, none waits for the others."""
    env = {"COMMSCHED_CONTROL_CHANNEL": "tcp", "COMMSCHED_CONTROL_ADDRESS": "nosuchif0"}
    result = run_ranks(2, PROGRAM.name, "--expect", "init-error", env=env, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    output = unglue(result.stdout, "rank ")
    assert output.count("init failed: ") == 2, output
    assert "COMMSCHED_CONTROL_ADDRESS=nosuchif0 is neither an IPv4 address nor an interface" in output, output


def _netrig() -> ModuleType:
    """benchmarks/netrig.py, a script folder's module."""
    spec = importlib.util.spec_from_file_location("netrig", NETRIG)
    assert spec and spec.loader
    module = sys.modules.get("netrig") or importlib.util.module_from_spec(spec)
    sys.modules["netrig"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


NETRIG = ROOT / "benchmarks" / "netrig.py"
_RIG_OK, _RIG_WHY = _netrig().available()
needs_rig = pytest.mark.skipif(not _RIG_OK, reason=f"needs the shaped-network rig: {_RIG_WHY}")


def _start_on_rig(expect: str, env: dict[str, str]) -> subprocess.Popen[str]:
    """Starts the rank program on 2 ranks in network namespaces of their own (a rig per call)."""
    argv = [sys.executable, str(NETRIG), "--ranks", "2", "--rate", "1gbit", "--queue", "priority", "--"]
    argv += [sys.executable, "-m", "mpi4py", str(PROGRAM), "--expect", expect]
    return subprocess.Popen(
        argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _output_of(job: subprocess.Popen[str]) -> str:
    """Waits for a job of _start_on_rig; its output, once it exited 0."""
    try:
        stdout, stderr = job.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        job.kill()
        stdout, stderr = job.communicate()
    assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return stdout + stderr


def _on_rig(expect: str, env: dict[str, str]) -> str:
    """Runs the rank program on 2 ranks in network namespaces of their own; returns its output."""
    return _output_of(_start_on_rig(expect, env))


@needs_mpi
@needs_rig
def test_auto_across_network_stacks_takes_the_channel() -> None:
    """Ranks in separate network namespaces: auto puts every round on the TCP channel, results exact."""
    _ok_lines(_on_rig("tcp", {**SIZES, "COMMSCHED_CONTROL_CHANNEL": "auto"}), 2, "tcp", one_host=False)


@needs_mpi
@needs_rig
def test_a_channel_that_cannot_connect_falls_back_under_auto_and_fails_under_tcp() -> None:
    """Each rank advertising 127.0.0.1 from its own namespace: no peer reaches it. auto warns and keeps
    the rounds on MPI on both ranks; tcp fails init() on both ranks, saying why."""
    # The connect wait is the stall shutdown clamped to [10, 30] s: its floor keeps the test short,
    # and the two jobs wait side by side, each on a rig of its own.
    unreachable = {
        **SIZES,
        "COMMSCHED_CONTROL_ADDRESS": "127.0.0.1",
        "COMMSCHED_STALL_TIMEOUT": "5",
        "COMMSCHED_STALL_SHUTDOWN": "10",
    }
    under_auto = _start_on_rig("transport", {**unreachable, "COMMSCHED_CONTROL_CHANNEL": "auto"})
    under_tcp = _start_on_rig("init-error", {**unreachable, "COMMSCHED_CONTROL_CHANNEL": "tcp"})
    try:
        output = _output_of(under_auto)
        _ok_lines(output, 2, "transport")
        assert output.count("the TCP control channel could not connect") >= 2, output
        output = unglue(_output_of(under_tcp), "rank ")
    finally:
        for job in (under_auto, under_tcp):
            if job.poll() is None:  # a failed check above: the rig takes its namespaces down on SIGTERM
                job.terminate()
                try:
                    job.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.communicate()
    assert output.count("init failed: ") == 2, output
    assert "COMMSCHED_CONTROL_CHANNEL=tcp: the TCP control channel could not connect" in output, output
