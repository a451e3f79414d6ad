"""gRPC ranks meeting at start: a rank that never starts is named by the others within the join
limit (with its address, the limit and the setting to check), one that starts a little late still
joins, over rank 0's rendezvous and over an explicit COMMSCHED_GRPC_PEERS list, at 3 ranks."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from commsched.run import free_port
from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_net import endpoint_from
from commsched.transports.grpc_rendezvous import join_rendezvous
from commsched.transports.grpc_transport import GrpcError, GrpcTransport

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"
LIMIT_S = 2.5
SETTING = "COMMSCHED_STALL_SHUTDOWN, the larger stall limit"


def start_ranks(
    size: int,
    peers: bool,
    ranks: list[int],
    delays: dict[int, float] | None = None,
    limit_s: float = LIMIT_S,
    tls: list[Any] | None = None,
    port: int = 0,
) -> tuple[list[Any], list[str], float]:
    """Builds the transports of `ranks` (each after its delay) as separate processes would; returns
    per rank the transport or the exception, the peer list (empty for a rendezvous) and the seconds taken."""
    port = port or free_port()
    addresses = [f"127.0.0.1:{port if r == 0 else free_port()}" for r in range(size)] if peers else []
    made: list[Any] = [None] * size
    delays = delays or {}

    def build(rank: int) -> None:
        time.sleep(delays.get(rank, 0.0))
        endpoint = endpoint_from(rank, size, "127.0.0.1", port, addresses, "", False)
        try:
            made[rank] = GrpcTransport(
                endpoint,
                TOKEN,
                timeout_s=1.0,
                join_timeout_s=limit_s,
                join_limit_setting=SETTING,
                tls=tls[rank] if tls else None,
            )
        except Exception as error:  # noqa: BLE001 - the test reads it
            made[rank] = error

    started = time.monotonic()
    threads = [threading.Thread(target=build, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(limit_s + 20)
    assert not any(thread.is_alive() for thread in threads), "a rank still waits past its join limit"
    return made, addresses, time.monotonic() - started


def close_all(made: list[Any]) -> None:
    """Closes every transport that was built."""
    for transport in made:
        if isinstance(transport, GrpcTransport):
            transport.close()


def exchange_and_allreduce(made: list[GrpcTransport]) -> None:
    """Every rank's report reaches every rank and an allreduce sums, so the late rank really joined."""
    size = len(made)
    got: list[Any] = [None] * size
    arrays = [np.full(1000, r + 1, np.float32) for r in range(size)]
    ops: list[Any] = [None] * size

    def run(rank: int) -> None:
        got[rank] = made[rank].exchange(b"r%d" % rank, 5.0)
        ops[rank] = made[rank].start(arrays[rank].ctypes.data, 1000, "float32", "allreduce", 0)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert got == [[b"r%d" % r for r in range(size)]] * size
    deadline = time.monotonic() + 10
    while not all(op.test() for op in ops):
        assert time.monotonic() < deadline, "allreduce did not finish"
        time.sleep(0.002)
    total = sum(range(1, size + 1))
    assert all((array == total).all() for array in arrays)


def start_mismatched_sizes(endpoint_of: Any) -> tuple[list[Any], float]:
    """Rank 0 with WORLD_SIZE=2 and rank 1 with WORLD_SIZE=3, each from endpoint_of(rank, size), built
    at once: what each made (a transport or its error) and the seconds until both ended, all closed."""
    made: list[Any] = [None, None]

    def build(rank: int, size: int) -> None:
        try:
            made[rank] = GrpcTransport(endpoint_of(rank, size), TOKEN, timeout_s=1.0, join_timeout_s=8.0)
        except Exception as error:  # noqa: BLE001 - the test reads it
            made[rank] = error

    started = time.monotonic()
    threads = [threading.Thread(target=build, args=args) for args in ((0, 2), (1, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    took = time.monotonic() - started
    close_all(made)
    return made, took


def test_listed_peer_that_never_starts_is_named_within_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    """COMMSCHED_GRPC_PEERS lists 3 ranks, rank 2 never starts: ranks 0 and 1 fail after the join
    limit naming rank 2, its address, the limit, the variable that sets it and COMMSCHED_GRPC_PEERS,
    and say they wait while they wait."""
    caplog.set_level(logging.WARNING, logger="commsched")
    made, addresses, took = start_ranks(3, True, [0, 1])
    close_all(made)
    for rank in (0, 1):
        error = made[rank]
        assert isinstance(error, GrpcError), (rank, error)
        text = str(error)
        assert f"rank {rank} could not reach rank 2 at {addresses[2]} within {LIMIT_S:g}s" in text, text
        assert f"set by {SETTING}" in text and "COMMSCHED_GRPC_PEERS" in text and "entry 2" in text, text
        assert "rank 0 at" not in text and "rank 1 at" not in text, text  # only the missing one is named
    assert LIMIT_S <= took < LIMIT_S + 4, took
    waits = [r.getMessage() for r in caplog.records if "waiting to reach rank 2" in r.getMessage()]
    assert waits and "giving up after 2.5s" in waits[0], waits


def test_listed_peer_that_starts_late_still_joins() -> None:
    """Rank 2 starts 1.2 s after the others, within the 4 s limit: the job forms and works."""
    made, _, took = start_ranks(3, True, [0, 1, 2], {2: 1.2}, limit_s=4.0)
    try:
        assert all(isinstance(t, GrpcTransport) for t in made), made
        exchange_and_allreduce(made)
        assert took < 4.0, took  # reached within about a second of its start, not after gRPC's backoff
    finally:
        close_all(made)


def test_rank_that_never_joins_the_rendezvous_is_named_on_every_rank() -> None:
    """Rank 2 never starts: rank 0 names it after the limit, and rank 1, which joined, hears the
    same from rank 0 instead of waiting for the stall limit."""
    made, _, took = start_ranks(3, False, [0, 1])
    close_all(made)
    assert isinstance(made[0], GrpcError) and isinstance(made[1], GrpcError), made
    assert "rank 0: ranks [2] did not join at 127.0.0.1:" in str(made[0]), made[0]
    assert f"within {LIMIT_S:g}s (the join limit, set by {SETTING})" in str(made[0]), made[0]
    assert "rank 1: ranks [2] did not join rank 0 within" in str(made[1]), made[1]
    assert "MASTER_ADDR/MASTER_PORT" in str(made[1]), made[1]
    assert LIMIT_S <= took < LIMIT_S + 4, took


def test_rank_zero_that_starts_late_still_holds_the_rendezvous() -> None:
    """Rank 0 starts 1.2 s after ranks 1 and 2, within the 4 s limit: the job forms and works."""
    made, _, took = start_ranks(3, False, [0, 1, 2], {0: 1.2}, limit_s=4.0)
    try:
        assert all(isinstance(t, GrpcTransport) for t in made), made
        exchange_and_allreduce(made)
        assert took < 4.0, took
    finally:
        close_all(made)


def test_rank_gone_after_it_joined_is_named_at_once() -> None:
    """Rank 2 joins rank 0 with the address of a server that is gone by the time the others dial
    it: ranks 0 and 1 name it within about a second, not after the 8 s join limit."""
    port = free_port()
    gone = f"127.0.0.1:{free_port()}"  # nothing listens there

    def join_as_rank_two() -> None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        request = wire.JoinRequest(rank=2, size=3, address=gone)
        metadata = [("commsched-token", TOKEN), ("commsched-rank", "2"), ("commsched-channel", "join")]
        with contextlib.suppress(Exception):
            join_rendezvous(
                channel, f"127.0.0.1:{port}", request, metadata, time.monotonic() + 8, None, TOKEN
            )
        channel.close()

    joiner = threading.Thread(target=join_as_rank_two)
    joiner.start()
    made, _, took = start_ranks(3, False, [0, 1], limit_s=8.0, port=port)
    joiner.join(10)
    close_all(made)
    for rank in (0, 1):
        text = str(made[rank])
        assert isinstance(made[rank], GrpcError), made
        assert (
            f"rank {rank}: rank 2 joined rank 0 from {gone}, but its server there refuses connections" in text
        )
    assert took < 5, took


def test_a_rank_with_another_world_size_ends_the_rendezvous_at_once() -> None:
    """Rank 1 joins with WORLD_SIZE=3 a rank 0 of WORLD_SIZE=2: both name the two sizes at once
    instead of rank 0 waiting out the 8 s limit for a rank 1 it refused."""
    port = free_port()
    made, took = start_mismatched_sizes(
        lambda rank, size: endpoint_from(rank, size, "127.0.0.1", port, [], "", False)
    )
    assert all(isinstance(error, GrpcError) for error in made), made
    assert "rank 0: rank 1 (" in str(
        made[0]
    ) and "joined with WORLD_SIZE=3, but this rank has WORLD_SIZE=2" in str(made[0]), made[0]
    assert "rank 1: rank 0 at 127.0.0.1:" in str(made[1]) and "rank 0 has WORLD_SIZE=2, this rank 3" in str(
        made[1]
    ), made[1]
    assert took < 4, took


def test_listed_peers_with_another_world_size_fail_at_once() -> None:
    """Rank 1 lists three peers with WORLD_SIZE=3, rank 0 two with WORLD_SIZE=2: rank 1 refuses
    rank 0's streams, and both name the two sizes at once instead of waiting out the 8 s limit
    (rank 1 for a rank 2 that does not exist, rank 0 for rank 1's first report)."""
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    made, took = start_mismatched_sizes(
        lambda rank, size: endpoint_from(rank, size, "", 0, addresses[:size], "", False)
    )
    assert all(isinstance(error, GrpcError) for error in made), made
    for rank in (0, 1):
        assert "rank 0 (" in str(made[rank]) and "has WORLD_SIZE=2, but rank 1 has WORLD_SIZE=3" in str(
            made[rank]
        ), made[rank]
        assert "COMMSCHED_GRPC_PEERS" in str(made[rank]), made[rank]
    assert took < 4, took


def test_listed_peer_with_a_certificate_of_another_ca_is_named_not_waited_for() -> None:
    """COMMSCHED_GRPC_PEERS with TLS, rank 1 (starting 1 s late) holds a certificate of another CA:
    both ranks name the TLS refusal within a few seconds instead of waiting out the 8 s limit."""
    pytest.importorskip("cryptography")
    from test_grpc_tls import _authority, _rank_files

    files = [_rank_files(_authority()), _rank_files(_authority())]
    made, _, took = start_ranks(2, True, [0, 1], {1: 1.0}, limit_s=8.0, tls=files)
    close_all(made)
    for rank in (0, 1):
        assert isinstance(made[rank], GrpcError), made
        assert f"rank {1 - rank} at 127.0.0.1" in str(made[rank]), made[rank]
        assert "COMMSCHED_GRPC_TLS_" in str(made[rank]) and "certificate" in str(made[rank]), made[rank]
    assert took < 6, took


def test_init_names_the_missing_peer_and_the_stall_variable() -> None:
    """Through commsched.init: rank 0 of a 2-rank peer list whose rank 1 never starts fails after
    COMMSCHED_STALL_SHUTDOWN (the larger stall limit), naming rank 1, its address and the variable."""
    peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "2",
        "COMMSCHED_TRANSPORT": "grpc",
        "COMMSCHED_GRPC_PEERS": ",".join(peers),
        "COMMSCHED_JOB_TOKEN": TOKEN,
        "COMMSCHED_STALL_TIMEOUT": "1",
        "COMMSCHED_STALL_SHUTDOWN": "2",
    }
    for variable in list(env):
        if variable.startswith(("PMI_", "PMIX_", "OMPI_", "MASTER_", "TORCHELASTIC_", "LOCAL_")):
            del env[variable]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", "import commsched; commsched.init()"],
        check=False,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    took = time.monotonic() - started
    assert done.returncode != 0, done.stdout + done.stderr
    expected = (
        f"rank 0 could not reach rank 1 at {peers[1]} within 2s "
        "(the join limit, set by COMMSCHED_STALL_SHUTDOWN, the larger stall limit)"
    )
    assert expected in done.stderr, done.stderr[-3000:]
    assert took < 15, took
