"""gRPC transport between real endpoints: exchanges and collectives over two transports in one
process, refusal of bad peers and bad frames, and failure of the other ranks when one dies."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from mpirun import local_launch, unglue  # tests/ is on sys.path (conftest.py)
from test_grpc_ring import make_frame

from commsched.run import free_port
from commsched.transports import grpc_wire as wire
from commsched.transports.grpc_net import endpoint_from
from commsched.transports.grpc_transport import JOIN_METHOD, STREAM_METHOD, GrpcError, GrpcTransport

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "test-token-0123456789"


# ------------------------------------------------------------------ two transports in one process


def make_pair(timeout_s: float = 5.0, peers: bool = False, **options: Any) -> list[GrpcTransport]:
    """Two connected transports (rank 0 and 1) built concurrently, as two processes would."""
    port = free_port()
    addresses = [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"] if peers else []
    made: list[Any] = [None, None]

    def build(rank: int) -> None:
        endpoint = endpoint_from(rank, 2, "127.0.0.1", port, addresses, "", False)
        made[rank] = GrpcTransport(endpoint, TOKEN, timeout_s=timeout_s, **options)

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert all(made), "rendezvous failed"
    return made


def wait_all(ops: list[Any], timeout_s: float = 10.0) -> list[str]:
    """Polls ops like the core does; returns '' per op that finished or its error text."""
    results: list[str | None] = [None] * len(ops)
    deadline = time.monotonic() + timeout_s
    while None in results and time.monotonic() < deadline:
        for index, op in enumerate(ops):
            if results[index] is None:
                try:
                    if op.test():
                        results[index] = ""
                except GrpcError as error:
                    results[index] = str(error)
        time.sleep(0.002)
    assert None not in results, "an op neither finished nor failed: a hang"
    return [r or "" for r in results]


def allreduce_pair(pair: list[GrpcTransport], count: int = 10_000) -> list[str]:
    """One float32 allreduce on both ranks; checks the sum when it succeeds."""
    arrays = [np.arange(count, dtype=np.float32) * (r + 1) for r in range(2)]
    errors = wait_all(
        [t.start(a.ctypes.data, count, "float32", "allreduce", 0) for t, a in zip(pair, arrays)]
    )
    if not any(errors):
        for array in arrays:
            assert np.array_equal(array, np.arange(count, dtype=np.float32) * 3)
    return errors


@pytest.mark.parametrize("peers", [False, True])
def test_pair_exchange_allreduce_broadcast(peers: bool) -> None:
    """Rendezvous (MASTER_ADDR or peer list), an exchange, an allreduce and a broadcast."""
    pair = make_pair(peers=peers, piece_bytes=4096)
    try:
        got: list[Any] = [None, None]
        threads = [
            threading.Thread(target=lambda r=r: got.__setitem__(r, pair[r].exchange(b"r%d" % r, 5)))
            for r in range(2)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert got == [[b"r0", b"r1"], [b"r0", b"r1"]]
        assert allreduce_pair(pair) == ["", ""]
        values = [np.full(3000, r, np.int64) for r in range(2)]
        assert wait_all(
            [t.start(v.ctypes.data, 3000, "int64", "broadcast", 1) for t, v in zip(pair, values)]
        ) == ["", ""]
        assert all((v == 1).all() for v in values)
    finally:
        for transport in pair:
            transport.close()


def test_pieces_spread_over_several_data_streams() -> None:
    """With three data streams per neighbour, pieces of one collective travel on all three and
    every collective still sums (allreduce of 3 ranks' worth of pieces, then a broadcast)."""
    pair = make_pair(piece_bytes=4096, streams=3)
    try:
        assert len(pair[0]._node._global.outboxes) == 3
        for count in (10_000, 100_003):
            assert allreduce_pair(pair, count) == ["", ""]
        values = [np.full(50_000, r + 7, np.int32) for r in range(2)]
        assert wait_all(
            [t.start(v.ctypes.data, v.size, "int32", "broadcast", 0) for t, v in zip(pair, values)]
        ) == ["", ""]
        assert all((v == 7).all() for v in values)
    finally:
        for transport in pair:
            transport.close()


def test_a_set_numbers_its_collectives_apart_and_waits_on_no_global_one() -> None:
    """A process set of both ranks has its own ring and numbering: its allreduce, begun on rank 0
    only, waits while global collectives finish around it; it finishes once rank 1 begins it, with
    broadcast roots read as positions in the set. A set of one rank finishes alone."""
    pair = make_pair(piece_bytes=4096)
    try:
        for transport in pair:
            transport.add_process_set(3, [0, 1])
            transport.add_process_set(4, [transport.rank])
        pending_set = np.arange(5000, dtype=np.float64)
        first = pair[0].start(pending_set.ctypes.data, 5000, "float64", "allreduce", 0, process_set=3)
        for _ in range(2):
            assert allreduce_pair(pair) == ["", ""]
        assert not first.test()
        other = np.arange(5000, dtype=np.float64) * 2
        second = pair[1].start(other.ctypes.data, 5000, "float64", "allreduce", 0, process_set=3)
        assert wait_all([first, second]) == ["", ""]
        for array in (pending_set, other):
            np.testing.assert_array_equal(array, np.arange(5000) * 3.0)
        values = [np.full(3000, r + 5, np.int64) for r in range(2)]
        assert wait_all(
            [
                t.start(v.ctypes.data, 3000, "int64", "broadcast", 1, process_set=3)
                for t, v in zip(pair, values)
            ]
        ) == ["", ""]
        assert all((v == 6).all() for v in values)
        alone = np.arange(10, dtype=np.float32)
        assert wait_all([pair[1].start(alone.ctypes.data, 10, "float32", "allreduce", 0, process_set=4)]) == [
            ""
        ]
        np.testing.assert_array_equal(alone, np.arange(10, dtype=np.float32))
        for transport in pair:
            transport.remove_process_set(3)
            transport.add_process_set(3, [0, 1])  # the same id again gets fresh streams
        assert allreduce_pair(pair) == ["", ""]
        again = [np.full(100, r + 1.0) for r in range(2)]
        assert wait_all(
            [
                t.start(v.ctypes.data, 100, "float64", "allreduce", 0, process_set=3)
                for t, v in zip(pair, again)
            ]
        ) == ["", ""]
        assert all((v == 3.0).all() for v in again)
    finally:
        for transport in pair:
            transport.close()


def test_a_stalled_set_collective_is_named_with_its_set() -> None:
    """A set's collective that its other member never begins fails on the watchdog, naming the set."""
    pair = make_pair(timeout_s=1.0)
    try:
        for transport in pair:
            transport.add_process_set(2, [0, 1])
        array = np.ones(100, dtype=np.float32)
        [error] = wait_all([pair[0].start(array.ctypes.data, 100, "float32", "allreduce", 0, process_set=2)])
        assert "no data from rank 1" in error and "process set 2 [0, 1]" in error, error
    finally:
        for transport in pair:
            transport.close()


def test_wrong_token_is_refused_and_logged_and_the_job_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """A stream or join without the token gets PERMISSION_DENIED; the next allreduce still works."""
    pair = make_pair()
    try:
        channel = grpc.insecure_channel(pair[1].addresses[1])
        stream = channel.stream_unary(
            STREAM_METHOD,
            request_serializer=wire.Frame.SerializeToString,
            response_deserializer=wire.Ack.FromString,
        )
        join = channel.unary_unary(
            JOIN_METHOD,
            request_serializer=wire.JoinRequest.SerializeToString,
            response_deserializer=wire.JoinReply.FromString,
        )
        with caplog.at_level("WARNING", logger="commsched"):
            for metadata in ([("commsched-token", "wrong-token")], []):
                with pytest.raises(grpc.RpcError) as refused:
                    stream(
                        iter([wire.Frame(channel=wire.CONTROL, src=0, seq=0)]),
                        metadata=metadata + [("commsched-rank", "0"), ("commsched-channel", "control")],
                        timeout=5,
                    )
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as refused:
                join(
                    wire.JoinRequest(rank=1, size=2, address="x:1"),
                    metadata=[("commsched-token", "bad")],
                    timeout=5,
                )
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # One line per interval, however many are refused (test_grpc_tls.py floods it).
        assert caplog.text.count("wrong job token") == 1
        # An impostor with the token cannot open a second stream in a rank's name either.
        with pytest.raises(grpc.RpcError) as refused:
            stream(
                iter([wire.Frame(channel=wire.CONTROL, src=0, seq=0)]),
                timeout=5,
                metadata=[
                    ("commsched-token", TOKEN),
                    ("commsched-rank", "0"),
                    ("commsched-channel", "control"),
                ],
            )
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        channel.close()
        assert allreduce_pair(pair) == ["", ""]
    finally:
        for transport in pair:
            transport.close()


def assert_every_next_exchange_fails(pair: list[GrpcTransport], timeout_s: float) -> None:
    """After a broken stream, every rank's next collective fails instead of waiting."""
    for transport in pair:
        with pytest.raises(GrpcError):
            transport.exchange(b"", timeout_s)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (make_frame(seq=0, dtype="float32", count=5000, payload=b"\0" * 100), "truncated payload"),
        (make_frame(seq=0, dtype="float32", count=5, payload=b"\0" * 100), "oversized payload"),
        (
            make_frame(seq=0, dtype="int64", count=5000, payload=b"\0" * 40000),
            "dtype 'int64', expected 'float32'",
        ),
        (
            make_frame(seq=0, offset=100, count=1024, payload=b"\0" * 4096),
            "elements 100\\+1024, expected 0\\+1024",
        ),
    ],
)
def test_bad_frame_fails_both_ranks_with_the_reason(frame: Any, message: str) -> None:
    """A malformed frame from the ring neighbour fails the receiver with the reason, and its sender too.

    The receiver's collective fails. A 2-rank allreduce this small goes in one hop, so the sender
    may already hold rank 1's whole buffer and finish before the rejection reaches it; then its
    next collective must fail, naming the rejection, instead of waiting.
    """
    pair = make_pair(piece_bytes=4096)
    try:
        pair[0]._node._outboxes[(1, "data")].put(frame)  # as if rank 0 sent garbage
        errors = allreduce_pair(pair)
        assert re.search(message, errors[1]), errors
        if not errors[0]:
            with pytest.raises(GrpcError, match=message):
                pair[0].exchange(b"", 5)
        assert_every_next_exchange_fails(pair, 2)
    finally:
        for transport in pair:
            transport.close()


def test_sender_that_finished_first_fails_its_next_collective() -> None:
    """When the receiver rejects a frame only after the sender's one-hop allreduce finished,
    the sender's next collective fails with the receiver's reason instead of waiting."""
    pair = make_pair(piece_bytes=4096)
    receiver = pair[1]._node
    lane_of = receiver._lane_of

    def slow_lane_of(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.3)  # rank 1 reads rank 0's frames late; its own have left already
        return lane_of(*args, **kwargs)

    receiver._lane_of = slow_lane_of
    try:
        pair[0]._node._outboxes[(1, "data")].put(
            make_frame(seq=0, dtype="int64", count=5000, payload=b"\0" * 40000)
        )
        errors = allreduce_pair(pair)
        assert errors[0] == "" and "dtype 'int64'" in errors[1], errors
        with pytest.raises(GrpcError, match="rank 1 rejected a frame from rank 0"):
            pair[0].exchange(b"", 5)
    finally:
        for transport in pair:
            transport.close()


def test_frame_above_the_grpc_limit_is_refused_not_hung() -> None:
    """A frame bigger than the message limit is stopped by gRPC; both ranks fail instead of waiting."""
    pair = make_pair(piece_bytes=4096, max_frame_bytes=100_000)
    try:
        big = make_frame(seq=0, dtype="uint8", count=300_000, payload=b"x" * 300_000)
        pair[0]._node._outboxes[(1, "data")].put(big)
        errors = allreduce_pair(pair)
        # Either rank may notice first: rank 0 from gRPC's own refusal, rank 1 from the stream it
        # lost. Rank 0 may finish this one-hop allreduce before; its next collective fails then.
        assert errors[1], errors
        assert any("RESOURCE_EXHAUSTED" in e or "lost the data stream from rank 0" in e for e in errors), (
            errors
        )
        assert_every_next_exchange_fails(pair, 5)
    finally:
        for transport in pair:
            transport.close()


def test_unreachable_rank_zero_is_named_quickly() -> None:
    """A rank that cannot reach the rendezvous fails within its timeout, naming the address."""
    port = free_port()
    started = time.monotonic()
    with pytest.raises(GrpcError, match=f"could not join rank 0 at 127.0.0.1:{port} within 1s"):
        GrpcTransport(endpoint_from(1, 2, "127.0.0.1", port, [], "", False), TOKEN, timeout_s=1.0)
    assert time.monotonic() - started < 10


def test_exchange_timeout_names_the_silent_rank() -> None:
    """When a peer never reports, exchange raises after the timeout naming that rank."""
    pair = make_pair()
    try:
        with pytest.raises(GrpcError, match=r"no agreement report from ranks \[1\]"):
            pair[0].exchange(b"", 0.5)
    finally:
        for transport in pair:
            transport.close()


# ------------------------------------------------------------------ whole jobs through the core


def job_environment(stall_timeout: str = "10") -> dict[str, str]:
    """Environment for a launched job: this checkout first, no inherited launcher variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMMSCHED_", "PMI_", "OMPI_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(PYTHONPATH=str(ROOT), COMMSCHED_JOB_TOKEN=TOKEN, COMMSCHED_STALL_TIMEOUT=stall_timeout)
    return env


def test_intruder_without_token_is_refused_while_the_job_goes_on(tmp_path: Path) -> None:
    """During a 2-rank job, a connection with a wrong token is refused and logged; the job finishes."""
    port = free_port()
    pause = tmp_path / "intruded"
    script = str(ROOT / "tests" / "transport_ranks" / "grpc_job.py")
    command = local_launch(2, script, "--pause-file", str(pause), master_port=port)
    job = subprocess.Popen(
        command, env=job_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        join = channel.unary_unary(
            JOIN_METHOD,
            request_serializer=wire.JoinRequest.SerializeToString,
            response_deserializer=wire.JoinReply.FromString,
        )
        deadline, code = time.monotonic() + 25, None
        while code is None and time.monotonic() < deadline:  # until rank 0 listens
            try:
                join(
                    wire.JoinRequest(rank=1, size=2, address="127.0.0.1:1"),
                    timeout=2,
                    wait_for_ready=True,
                    metadata=[("commsched-token", "not-the-token"), ("commsched-rank", "1")],
                )
            except grpc.RpcError as error:
                code = error.code() if error.code() != grpc.StatusCode.DEADLINE_EXCEEDED else None
        channel.close()
        pause.touch()
        output, _ = job.communicate(timeout=60)
    finally:
        job.kill()
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert job.returncode == 0, output
    assert "refused a connection" in output and "wrong job token" in output, output
    assert "rank 0: OK" in output and "rank 1: OK" in output, output


def test_killed_rank_fails_the_others_within_the_stall_timeout() -> None:
    """SIGKILL of rank 2 of 3: ranks 0 and 1 stop with an error naming rank 2, well before 10 s."""
    script = str(ROOT / "tests" / "transport_ranks" / "grpc_job.py")
    command = local_launch(3, script, "--kill-rank", "2", "--kill-after", "1", "--rounds", "100")
    done = subprocess.run(
        command, env=job_environment("10"), capture_output=True, text=True, timeout=90, check=False
    )
    # Both ranks write to one pipe: a line may land glued to the other's.
    output = unglue(done.stdout + done.stderr, "rank 0: FAILED", "rank 1: FAILED")
    assert done.returncode != 0
    for rank in (0, 1):
        line = next((line for line in output.splitlines() if line.startswith(f"rank {rank}: FAILED")), "")
        assert "rank 2" in line, output
        assert float(line.split("after ")[1].split("s:")[0]) < 10, line
