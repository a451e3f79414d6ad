"""Elastic starts under commsched-run --min-np: a rank lost before or while the ranks start commsched
costs the others a re-forming, not the job, and never a rendezvous that waits for it. Each rank
checks in with the launcher's membership service before the rendezvous; the service lets the
generation start once every member is there, or re-forms the ones that are when a member's process
ended first. The check-in is exercised in-process, the starts through real ranks."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_elastic import assert_every_sample_once, launch, results

from commsched.elastic import membership


class _Processes:
    """What the launcher knows of its ranks' processes, as the server's callbacks see it."""

    def __init__(self, members: list[int]) -> None:
        self.running = set(members)
        self.ended: set[int] = set()
        self.evicted: list[list[int]] = []

    def end(self, member: int) -> None:
        self.running.discard(member)
        self.ended.add(member)


def _server(
    members: list[int], processes: _Processes, window_s: float = 5.0, max_np: int = 4
) -> membership.MembershipServer:
    return membership.MembershipServer(
        members=members,
        port=1,
        min_np=2,
        max_np=max_np,
        join_window_s=window_s,
        alive=lambda: set(processes.running),
        evict=lambda ranks, why: processes.evicted.append(ranks),
        pick_port=lambda: 4343,
        ended=lambda: set(processes.ended),
    )


def _check_in(server: membership.MembershipServer, member: int, generation: int = 0) -> Any:
    try:
        return membership.check_in(server.address, member, generation, wait_s=10.0)
    except (membership.MembershipError, TimeoutError) as error:
        return error


def test_check_in_lets_the_generation_start_once_every_member_is_there() -> None:
    """No rank goes to the rendezvous before the last one checked in; then all go."""
    processes = _Processes([0, 1, 2])
    server = _server([0, 1, 2], processes)
    try:
        with ThreadPoolExecutor(3) as pool:
            early = [pool.submit(_check_in, server, member) for member in (0, 1)]
            time.sleep(0.3)
            assert not any(answer.done() for answer in early)
            last = pool.submit(_check_in, server, 2)
            assert [answer.result(timeout=10) for answer in [*early, last]] == [None, None, None]
        assert server.settled and server.generation == 0
    finally:
        server.close()


def test_a_member_that_ended_before_it_checked_in_re_forms_the_others() -> None:
    """A member's process ended before it reached init(): the ranks at the check-in get their places in
    the next generation at once, in launch order, without waiting for the window."""
    processes = _Processes([0, 1, 2])
    server = _server([0, 1, 2], processes, window_s=30.0)
    try:
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(_check_in, server, member) for member in (2, 0)]
            time.sleep(0.2)
            started = time.monotonic()
            processes.end(1)
            answers = [answer.result(timeout=10) for answer in waiting]
        assert time.monotonic() - started < 5
        assert [(a.rank, a.size, a.port, a.generation) for a in answers] == [(1, 2, 4343, 1), (0, 2, 4343, 1)]
        assert not processes.evicted
    finally:
        server.close()


def test_a_member_that_died_after_it_checked_in_is_not_a_survivor() -> None:
    """Ranks 0 and 1 checked in, then rank 1's process ended: the next generation is ranks 0 and 2,
    without waiting for another failed start to find out about rank 1."""
    processes = _Processes([0, 1, 2])
    server = _server([0, 1, 2], processes, window_s=30.0)
    try:
        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(_check_in, server, member) for member in (0, 1)]
            time.sleep(0.2)
            processes.end(1)
            time.sleep(0.5)  # the server's poll re-forms, leaving rank 1's connection closed
            assert isinstance(waiting[1].result(timeout=10), membership.MembershipError)
            last = pool.submit(_check_in, server, 2)
            places = [waiting[0].result(timeout=10), last.result(timeout=10)]
        assert [(p.rank, p.size, p.generation) for p in places] == [(0, 2, 1), (1, 2, 1)]
        assert server.members == [0, 2]
    finally:
        server.close()


def test_a_joiner_not_started_yet_is_not_a_lost_member() -> None:
    """After a growth the new worker is started after the others got their places: the survivors wait
    at the check-in for it instead of re-forming without it."""
    processes = _Processes([0, 1])
    server = _server([0, 1], processes)
    try:
        assert server.grow([2])
        with ThreadPoolExecutor(3) as pool:
            asks = [pool.submit(_ask, server, member) for member in (0, 1)]
            places = [ask.result(timeout=10) for ask in asks]
            assert [(p.rank, p.size, p.generation) for p in places] == [(0, 3, 1), (1, 3, 1)]
            survivors = [pool.submit(_check_in, server, member, 1) for member in (0, 1)]
            time.sleep(0.3)
            assert not any(answer.done() for answer in survivors)
            processes.running.add(2)  # the launcher starts it now
            joiner = pool.submit(_check_in, server, 2, 1)
            assert [answer.result(timeout=10) for answer in [*survivors, joiner]] == [None, None, None]
    finally:
        server.close()


def test_growth_waits_while_a_generation_starts_and_a_late_check_in_joins_a_re_forming() -> None:
    """The launcher cannot plan a growth while ranks are checking in; a rank that checks in while a
    re-forming is pending takes part in it."""
    processes = _Processes([0, 1, 2])
    server = _server([0, 1, 2], processes, window_s=30.0)
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(_check_in, server, 0)
            time.sleep(0.2)
            assert not server.grow([3])
            processes.end(2)
            late = pool.submit(_check_in, server, 1)
            places = [first.result(timeout=10), late.result(timeout=10)]
        assert [(p.rank, p.size, p.generation) for p in places] == [(0, 2, 1), (1, 2, 1)]
    finally:
        server.close()


def _ask(server: membership.MembershipServer, member: int, generation: int = 0) -> Any:
    return membership.request(server.address, member, generation, wait_s=10.0)


def test_a_rank_killed_before_init_costs_a_re_forming(tmp_path: Path) -> None:
    """3 ranks over Gloo; the rank launched as 2 is SIGKILLed just before hvd.init(): the other two
    start as a generation of 2 and end exactly as a job launched with 2 ranks."""
    done = launch(
        tmp_path / "killed",
        "-n",
        "3",
        "--min-np",
        "2",
        ELASTIC_KILL="2:-2:-2:init",
        COMMSCHED_TRANSPORT="gloo",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 2 ranks (rank 2, numbered as at launch, lost)" in done.stderr, done.stderr[-3000:]
    final = results(tmp_path / "killed")
    assert final["size"] == 2
    assert_every_sample_once(final)
    reference = launch(tmp_path / "reference", "-n", "2", COMMSCHED_TRANSPORT="gloo")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = results(tmp_path / "reference")
    assert torch.equal(final["weight"], expected["weight"]) and final["seen"] == expected["seen"]


def test_rank_0_killed_before_init_over_grpc(tmp_path: Path) -> None:
    """Over gRPC the rank launched as 0 hosts the rendezvous: killed before init(), the other two
    re-form with the rank launched as 1 as their rank 0 and finish."""
    done = launch(
        tmp_path, "-n", "3", "--min-np", "2", ELASTIC_KILL="0:-2:-2:init", COMMSCHED_TRANSPORT="grpc"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 2 ranks (rank 0, numbered as at launch, lost)" in done.stderr, done.stderr[-3000:]
    final = results(tmp_path)
    assert final["size"] == 2
    assert_every_sample_once(final)


def test_a_rank_stopped_before_init_is_left_out_after_the_stall_limit(tmp_path: Path) -> None:
    """A rank SIGSTOPped before init() is alive to the launcher: the others wait at the check-in for
    the larger stall limit, then re-form; the launcher kills the stopped rank once the window passed."""
    started = time.monotonic()
    done = launch(
        tmp_path,
        "-n",
        "3",
        "--min-np",
        "2",
        "--elastic-timeout",
        "2",
        ELASTIC_STOP="2:-2:-2:init",
        COMMSCHED_TRANSPORT="gloo",
        COMMSCHED_STALL_TIMEOUT="1",
        COMMSCHED_STALL_SHUTDOWN="3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 2 (numbered as at launch) did not rejoin within 2s" in done.stderr, done.stderr[-3000:]
    assert results(tmp_path)["size"] == 2
    assert time.monotonic() - started < 60


def test_failed_ranks_leaving_a_stopped_one_end_the_job(tmp_path: Path) -> None:
    """Ranks 0 and 1 exit with an error before init() while rank 2 is stopped: one rank is left,
    below --min-np 2, so the launcher ends the job at once, naming the failed ranks, rather than
    wait for the stopped one forever."""
    started = time.monotonic()
    try:
        done = launch(
            tmp_path,
            "-n",
            "3",
            "--min-np",
            "2",
            ELASTIC_EXIT="0,1",
            ELASTIC_STOP="2:-2:-2:init",
            COMMSCHED_TRANSPORT="gloo",
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the launcher waited for the stopped rank")
    assert done.returncode == 1
    assert "ranks 0, 1 (numbered as at launch) failed; 1 rank is left, below --min-np 2" in done.stderr, (
        done.stderr[-3000:]
    )
    assert time.monotonic() - started < 45


def test_a_rank_killed_before_the_training_function_sharded(tmp_path: Path) -> None:
    """shard=True, 3 ranks over Gloo; the rank launched as 1 is SIGKILLed after init(), once the
    optimizer and the state are made but before elastic.run's function runs: the others re-form at 2,
    the optimizer lays out for 2 ranks, and the end equals a job launched with 2 ranks."""
    done = launch(
        tmp_path / "killed",
        "-n",
        "3",
        "--min-np",
        "2",
        ELASTIC_KILL="1:-2:-2:run",
        ELASTIC_SHARD="1",
        COMMSCHED_TRANSPORT="gloo",
        COMMSCHED_STALL_TIMEOUT="1",
        COMMSCHED_STALL_SHUTDOWN="3",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    final = results(tmp_path / "killed")
    assert final["size"] == 2
    assert_every_sample_once(final)
    reference = launch(tmp_path / "reference", "-n", "2", ELASTIC_SHARD="1", COMMSCHED_TRANSPORT="gloo")
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = results(tmp_path / "reference")
    assert torch.equal(final["weight"], expected["weight"]) and final["seen"] == expected["seen"]
