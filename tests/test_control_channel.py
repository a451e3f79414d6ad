"""The TCP control channel at 2 and 3 ranks over MPI, native Gloo and gRPC: collectives stay exact while every
agreement round travels over it; `auto` on one host keeps the transport's own exchange; bad settings
are refused with the variable named. (The channel's own protocol is tested in tests/cpp.)"""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

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


def _ok_lines(output: str, ranks: int, channel: str) -> None:
    output = unglue(output, "rank ")
    for rank in range(ranks):
        assert f"rank {rank}: OK" in output and f"rounds over {channel}" in output, output


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
    result = subprocess.run(
        local_launch(ranks, str(PROGRAM), "--expect", "tcp"),
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    _ok_lines(result.stdout, ranks, "tcp")
    assert f"over {transport}" in result.stdout


@needs_gloo
def test_a_departed_peer_is_named_by_every_other_rank() -> None:
    """Rank 1 of 3 exits mid-job: ranks 0 and 2 fail with RankFailure.rank == 1 from the channel, no hang."""
    env = {**clean_rank_env(ROOT), "COMMSCHED_TRANSPORT": "gloo", "COMMSCHED_CONTROL_CHANNEL": "tcp"}
    result = subprocess.run(
        local_launch(3, str(PROGRAM), "--expect", "peer-exits"),
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
