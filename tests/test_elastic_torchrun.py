"""Elastic training under torchrun's c10d rendezvous: 3 single-process agents, one worker SIGKILLs
itself after step(); the survivors agree on the new membership through torchrun's store, re-form
Gloo (or gRPC, at addresses exchanged through the store) at 2 ranks without restarting, and end
with the parameters of a 2-rank run started from the restored commit, every sample seen once per
epoch. A node that joins (Gloo; gRPC with shard=True) ends at the parameters of a 3-rank run from
the commit kept across torchrun's restart. The store-side agreement, the minimum, the gRPC address
exchange without the agent's store and the refusals are exercised in-process."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from commsched.elastic import membership, torchrun
from commsched.elastic.torchrun_resume import kept_path

sys.path.insert(0, str(Path(__file__).resolve().parent / "elastic_ranks"))
from torchrun_agents import environment, run_agents

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "elastic_ranks" / "train.py"
GROW_SCRIPT = ROOT / "tests" / "elastic_ranks" / "torchrun_grow.py"
SAMPLES = 48  # as in the rank script
LAUNCH_TIMEOUT_S = 90
AGENTS_END_S = 60  # from the fault to every agent's end; torch's exit barrier alone waits 300 s


def results(out: Path) -> dict[str, Any]:
    return torch.load(out / "final.pt", weights_only=False)


def test_sigkill_under_torchrun_equals_a_run_started_from_the_commit(tmp_path: Path) -> None:
    """3 ranks under torchrun, the one launched as 2 SIGKILLs itself after step() of step 3: the
    survivors re-form at 2 and end with the parameters of a 2-rank run from the restored commit;
    every agent ends soon after, not after torch's 300 s exit barrier."""
    killed_equals_reference(tmp_path, "gloo")


@pytest.mark.full  # gRPC's re-forming through torchrun's store: the sharded join below takes it too
def test_sigkill_under_torchrun_over_grpc_equals_a_run_started_from_the_commit(tmp_path: Path) -> None:
    """Over gRPC the same fault re-forms the same way: the survivors meet at new addresses exchanged
    through torchrun's store and end at the parameters of a 2-rank gRPC run from the same commit."""
    out = killed_equals_reference(tmp_path, "grpc")
    assert "re-forms the ranks over Gloo" not in out and "a failed rank ends the job" not in out


def killed_equals_reference(tmp_path: Path, transport: str) -> str:
    """The SIGKILL run on `transport` and its reference, compared; returns the elastic run's output."""
    out = tmp_path / "elastic"
    output = run_to_the_end(out, ELASTIC_KILL="2:0:3", COMMSCHED_TRANSPORT=transport)
    assert "rank 2 (numbered as at launch" not in output  # no rank was left out: it died
    final = results(out)
    assert final["size"] == 2
    assert_every_sample_once(final)
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 3 * 2}  # 3 commits of 3 ranks x 2
    assert_equals_a_run_from_the_commit(out, tmp_path / "reference", 2, COMMSCHED_TRANSPORT=transport)
    return output


def assert_equals_a_run_from_the_commit(out: Path, reference: Path, ranks: int, **extra: str) -> None:
    """`ranks` ranks under commsched-run, started from out/restored.pt, end with the parameters and
    the samples of out/final.pt."""
    reference.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "commsched.run", "-n", str(ranks), str(SCRIPT)],
        env=environment(reference, ELASTIC_START=str(out / "restored.pt"), **extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    final, expected = results(out), results(reference)
    assert torch.count_nonzero(expected["weight"]) > 0
    assert torch.equal(final["weight"], expected["weight"])
    assert final["seen"] == expected["seen"]


def test_sigstop_under_torchrun_ends_every_agent(tmp_path: Path) -> None:
    """The worker launched as 2 SIGSTOPs itself: the survivors' stall limit ends the step, they
    re-form at 2 without it, every sample is seen once per epoch, and every agent ends soon after."""
    run_to_the_end(
        tmp_path,
        ELASTIC_STOP="2:0:3",
        COMMSCHED_STALL_TIMEOUT="1",
        COMMSCHED_STALL_SHUTDOWN="3",
        COMMSCHED_ELASTIC_TIMEOUT="2",
    )
    assert_every_sample_once(results(tmp_path))


def test_a_worker_killed_before_the_training_function_under_torchrun_costs_a_re_forming(
    tmp_path: Path,
) -> None:
    """The worker launched as 2 is SIGKILLed after init(), once its optimizer and state are made but
    before elastic.run's function: the core recorded the worker group as it started, so the others
    re-form at 2 through torchrun's store and end exactly as a job launched with 2 ranks."""
    out = tmp_path / "killed"
    run_to_the_end(out, ELASTIC_KILL="2:-2:-2:run")
    final = results(out)
    assert final["size"] == 2
    assert_every_sample_once(final)
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 0}  # nothing trained yet
    assert_equals_a_run_from_the_commit(out, tmp_path / "reference", 2)


def test_a_worker_killed_before_init_under_torchrun_is_named_within_the_stall_limit(tmp_path: Path) -> None:
    """The worker launched as 2 is SIGKILLed just before init(): the others wait for it at most the
    larger stall limit (not torch's 30 minutes), then end naming it, and every agent ends."""
    started = time.monotonic()
    output = run_agents(
        tmp_path,
        SCRIPT,
        3,
        2,
        2,
        LAUNCH_TIMEOUT_S,
        wait_agents=True,
        ELASTIC_KILL="2:-2:-2:init",
        COMMSCHED_STALL_TIMEOUT="2",
        COMMSCHED_STALL_SHUTDOWN="4",
    )
    assert "--- agents ended at " in output, output[-4000:]
    assert time.monotonic() - started < 60, output[-4000:]
    assert output.count("did not all meet at") >= 2 and output.count("rank 2 never arrived") >= 2, output[
        -4000:
    ]
    assert not (tmp_path / "final.pt").exists()


def grow_under_torchrun(out: Path, **extra: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """2 agents under --nnodes 2:3; in step 3 of a job of 2 a third agent joins and torchrun restarts
    every worker: the old workers keep their last commit across the restart, are renumbered ahead of
    the joining worker (torchrun made it rank 0), which gets the commit through the state sync, and
    3 ranks end, every sample seen once per epoch and no kept commit left behind. Returns the final
    and the restored state."""
    # torch 2.13's agents keep the first round's address of the store they share with the workers,
    # and a node that joins waits for one the old agents do not write again: unshared, worker rank 0
    # hosts the workers' store, and the join goes through.
    output = run_agents(
        out,
        GROW_SCRIPT,
        2,
        2,
        3,
        LAUNCH_TIMEOUT_S,
        join_when="join",
        ELASTIC_JOIN="0:3:2",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        **extra,
    )
    assert output.count(" of 3 done") == 3, output[-4000:]
    assert output.count("SIGTERM: the last commit is kept in") == 2, output[-4000:]
    assert "rank 2 of 3 done" in output.partition("--- agent 2\n")[2]  # renumbered after the keepers
    for log in output.split("--- agent ")[1:]:  # the 3 went on as they resumed, no stall re-formed them
        assert "re-forming" not in log.partition("resumed at 3 ranks")[2], log[-3000:]
    final = results(out)
    assert final["size"] == 3
    assert_every_sample_once(final)
    restored = torch.load(out / "restored.pt", weights_only=False)
    # Rank 0 waited for the join before its commit of step 3: steps 0-2 of 2 ranks x 2 samples (the
    # 36 left split evenly over 3 ranks: an uneven split would repeat samples, as torch's sampler does).
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 2 * 2}
    assert "shard" not in restored["optimizer"]  # the plain form, whether the job shards or not
    assert torch.count_nonzero(restored["optimizer"]["state"][0]["momentum_buffer"]) > 0
    assert not list(
        kept_path({"TORCHELASTIC_RUN_ID": out.name}).parent.glob(f"commsched-elastic-{out.name}-*")
    )
    return final, restored


@pytest.fixture(scope="module")
def grown(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """The growth over Gloo: its directory, final and restored state."""
    out = tmp_path_factory.mktemp("torchrun-grown") / "grown"
    return (out, *grow_under_torchrun(out))


def test_a_node_that_joins_under_torchrun_keeps_the_last_commit(
    grown: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """Over Gloo the 3 ranks end with the parameters of a 3-rank run from the kept commit."""
    assert_equals_a_run_from_the_commit(grown[0], tmp_path / "reference", 3)


def test_a_node_joins_a_sharded_job_over_grpc_under_torchrun(
    grown: tuple[Path, dict[str, Any], dict[str, Any]], tmp_path: Path
) -> None:
    """The same growth over gRPC (rank 0 hosts the workers' store and its server listens on a port of
    its own) with DistributedOptimizer(shard=True) laid out as it is built: the keepers' restore
    joined every rank's shard, and the restarted workers lay out and cut again at 3 ranks. Commit
    and end equal the Gloo run's (the sums are exact), which equal a 3-rank run from the commit."""
    _, gloo_final, gloo_restored = grown
    final, restored = grow_under_torchrun(
        tmp_path / "grown-grpc", COMMSCHED_TRANSPORT="grpc", ELASTIC_SHARD="1"
    )
    assert torch.equal(restored["model"]["weight"], gloo_restored["model"]["weight"])
    assert torch.equal(
        restored["optimizer"]["state"][0]["momentum_buffer"],
        gloo_restored["optimizer"]["state"][0]["momentum_buffer"],
    )
    assert torch.equal(final["weight"], gloo_final["weight"])
    assert final["seen"] == gloo_final["seen"]


def run_to_the_end(out: Path, **fault: str) -> str:
    """3 agents under --nnodes 2:3 whose worker launched as 2 meets `fault`: both survivors finish
    and every agent ends within AGENTS_END_S of the fault, theirs with status 0; returns the output."""
    output = run_agents(out, SCRIPT, 3, 2, 2, LAUNCH_TIMEOUT_S, wait_agents=True, ELASTIC_TIMES="1", **fault)
    assert "rank 0 of 2 done" in output and "rank 1 of 2 done" in output, output[-4000:]
    assert "--- agents ended at " in output, f"an agent was still running at the timeout:\n{output[-4000:]}"
    ended = float(output.rpartition("--- agents ended at ")[2].split()[0])
    fault_at = float((out / "times.2").read_text().split()[0])
    assert ended - fault_at < AGENTS_END_S, f"the agents ended {ended - fault_at:.1f} s after the fault"
    assert "--- agent 0 exit 0\n" in output and "--- agent 1 exit 0\n" in output, output[-4000:]
    return output


def assert_every_sample_once(final: dict[str, Any]) -> None:
    """Each epoch saw every sample exactly once."""
    for epoch, seen in enumerate(final["seen"]):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples dropped or repeated"


def test_below_the_nnodes_minimum_under_torchrun_names_the_rank(tmp_path: Path) -> None:
    """--nnodes 3:3: losing the rank launched as 2 ends the job on the survivors, naming it."""
    output = run_agents(
        tmp_path, SCRIPT, 3, min_nodes=3, finishers=3, timeout_s=LAUNCH_TIMEOUT_S, ELASTIC_KILL="2:0:1"
    )
    words = "rank 2 (numbered as at launch) failed; 2 ranks are left, below the job's minimum of 3"
    assert output.count(words) >= 2, output[-4000:]  # both survivors say it
    assert not (tmp_path / "final.pt").exists()


class _Store:
    """A TCPStore server in this process, for the agreement without torchrun."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
        )
        self.port = self.store.port


def _job(monkeypatch: pytest.MonkeyPatch, port: int, member: int, members: list[int]) -> Any:
    """Makes this process worker `member` of a job whose store listens on `port`."""
    monkeypatch.setenv("RANK", str(member))
    monkeypatch.setenv("WORLD_SIZE", str(len(members)))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    job = torchrun._Job()
    job.prefix, job.members = "test", list(members)
    monkeypatch.setattr(torchrun, "_job", job)
    return job


def test_agreement_goes_on_once_every_member_asked_or_was_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Members 0 and 1 ask, naming rank 2 failed: the decision is [0, 1] at once (no window wait),
    ranks follow launch order, and a late member 2 is told it was left out."""
    server = _Store()
    monkeypatch.setenv(torchrun.MIN_VARIABLE, "2")
    monkeypatch.setenv(torchrun.TIMEOUT_VARIABLE, "30")
    _job(monkeypatch, server.port, 1, [0, 1, 2])
    server.store.set("test/g0/ask/0", "[2]")
    started = time.monotonic()
    assignment = torchrun.request(failed_rank=None)
    assert time.monotonic() - started < 5
    assert (assignment.rank, assignment.size, assignment.generation) == (1, 2, 1)
    _job(monkeypatch, server.port, 2, [0, 1, 2])
    with pytest.raises(membership.MembershipError, match="rank 2 .* was left out of generation 1"):
        torchrun.request(failed_rank=None)


def test_agreement_leaves_out_a_silent_member_after_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only member 2 asks and names nobody: after the window it goes on alone as rank 0 (minimum 1)."""
    server = _Store()
    monkeypatch.setenv(torchrun.MIN_VARIABLE, "1")
    monkeypatch.setenv(torchrun.TIMEOUT_VARIABLE, "0.3")
    _job(monkeypatch, server.port, 2, [0, 1, 2])
    started = time.monotonic()
    assignment = torchrun.request(failed_rank=None)
    assert 0.3 <= time.monotonic() - started < 5
    assert (assignment.rank, assignment.size) == (0, 1)
    assert torchrun.job().members == [2]


def test_minimum_comes_from_torchruns_nnodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MIN of the agent's --nnodes MIN:MAX times LOCAL_WORLD_SIZE; the variable overrides it."""
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "--nnodes", "3:5"])
    try:
        monkeypatch.delenv(torchrun.MIN_VARIABLE, raising=False)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setattr(os, "getppid", lambda: agent.pid)
        deadline = time.monotonic() + 10
        while torchrun._agent_min_nodes(agent.pid) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until the child has exec'd
        assert torchrun.min_ranks() == 6
        monkeypatch.setenv(torchrun.MIN_VARIABLE, "4")
        assert torchrun.min_ranks() == 4
        monkeypatch.setenv(torchrun.MIN_VARIABLE, "none")
        with pytest.raises(ValueError, match="COMMSCHED_ELASTIC_MIN_NP='none': give a number >= 1"):
            torchrun.min_ranks()
    finally:
        agent.kill()
        agent.wait()


def test_restarted_workers_without_a_kept_commit_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A later worker group of the run (a node joined) in which no worker found a kept commit, and
    workers torchrun restarted after a failure, refuse to go on, naming why."""
    import commsched
    from commsched.elastic import torchrun_resume

    server = _Store()
    job = _job(monkeypatch, server.port, 0, [0, 1])
    job.prefix = ""
    monkeypatch.setenv(torchrun.RUN_ID_VARIABLE, "refusals")
    torchrun.start(lambda value: value)  # the first worker group of the run
    assert (job.prefix, job.group) == ("commsched.elastic.refusals.1", 1)
    job.prefix = ""
    torchrun.start(lambda value: value)  # the next group: a node joined
    assert job.group == 2
    monkeypatch.setattr(torchrun_resume, "_SHARED_MEMORY", tmp_path)  # nothing kept there
    monkeypatch.setattr(torchrun_resume, "_resumed", False)
    monkeypatch.setattr(commsched, "allgather_object", lambda value, name=None: [value, False])
    with pytest.raises(membership.MembershipError, match="no worker kept the last commit"):
        torchrun_resume.resume(object())
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(membership.MembershipError, match="restarted the workers of this job after a failure"):
        torchrun.refuse_restarted()


def test_other_transports_say_at_start_that_a_failure_ends_the_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under torchrun on a transport other than Gloo, run says at start that the ranks will not
    re-form, and why, instead of failing."""
    import commsched
    from commsched import elastic

    monkeypatch.setenv(torchrun.RUN_ID_VARIABLE, "other")
    for name, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(membership.ADDRESS_VARIABLE, raising=False)
    monkeypatch.setattr(elastic, "_membership", elastic._Membership())
    monkeypatch.setattr(commsched._state, "transport", "nccl")
    assert elastic._check_launcher() is False
    message = capsys.readouterr().err
    assert "under torchrun commsched re-forms the ranks over Gloo and gRPC only, not nccl" in message, message
    assert "so a failed rank ends the job" in message


def test_without_the_agents_store_grpc_meets_through_the_one_rank_0_hosts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: worker rank 0 hosts the workers' store at MASTER_PORT
    and the gRPC addresses (fresh ports, not MASTER_PORT) are exchanged there; a MASTER_PORT already
    taken is named; with the agent's store nothing is exchanged."""
    import threading

    from torchrun_agents import free_port

    port = free_port()
    for name, value in (
        (torchrun.RUN_ID_VARIABLE, "unshared"),
        ("TORCHELASTIC_USE_AGENT_STORE", "False"),
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(port)),
    ):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torchrun, "_job", None)
    monkeypatch.setattr(torchrun, "_hosted", None)
    wait = datetime.timedelta(seconds=10)
    other: list[list[str]] = []

    def rank_1() -> None:  # connects once rank 0's store is up (a client retries until its timeout)
        store = torch.distributed.TCPStore("127.0.0.1", port, is_master=False, timeout=wait)
        assignment = membership.Assignment(1, 2, 0, 0)
        other.append(torchrun._grpc_peers(store, "commsched.grpc.unshared.first", assignment, wait))

    thread = threading.Thread(target=rank_1)
    thread.start()
    peers = torchrun.first_grpc_peers(0, 2, wait)
    thread.join()
    assert other == [peers] and len(set(peers)) == 2
    assert all(peer.startswith("127.0.0.1:") and peer != f"127.0.0.1:{port}" for peer in peers)
    monkeypatch.setattr(torchrun, "_job", None)  # another worker told the same MASTER_PORT
    hosted, torchrun._hosted = torchrun._hosted, None
    with pytest.raises(
        membership.MembershipError, match=rf"could not host the workers' store at MASTER_PORT={port}"
    ):
        torchrun.first_grpc_peers(0, 2, wait)
    torchrun._hosted = hosted
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert torchrun.first_grpc_peers(0, 2, wait) == []


def test_a_store_that_went_away_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent holding the store ended (its worker, rank 0 at launch, failed): the survivors'
    re-forming fails at once with an error naming the store and what to launch instead."""
    server = _Store()
    _job(monkeypatch, server.port, 1, [0, 1, 2]).store()  # connected while the store was up
    del server  # the store's server ends with its agent
    with pytest.raises(
        membership.MembershipError, match=r"torchrun's rendezvous store at 127\.0\.0\.1:\d+ does not"
    ):
        torchrun.request(failed_rank=0)


def test_exit_barrier_arrival_for_agents_whose_workers_are_all_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """Agents 1 and 2 of 4 lost all their workers, agent 3 one of two: the new rank 0 arrives once
    for each of 1 and 2 in the round that named this MASTER_PORT (for 3 once its other worker is
    lost too), and not at all under another key layout."""
    from torch.distributed.elastic.utils import store as store_util

    from commsched.elastic import exit_barrier

    server = _Store()
    workers, agents = server.store, torch.distributed.PrefixStore("torch.rendezvous.run.1", server.store)
    monkeypatch.setenv("MASTER_PORT", "4321")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    server.store.set("torch.rendezvous.run.0/MASTER_PORT", "1234")  # another job's round
    agents.set("MASTER_PORT", "4321")
    for member, agent in enumerate([0, 1, 2, 3, 3]):
        monkeypatch.setenv("GROUP_RANK", str(agent))
        exit_barrier.record_agent(workers, "job", member)
    endpoint = f"127.0.0.1:{server.port}"
    counter = "torchelastic/agent/terminal_state/num_members"
    monkeypatch.setattr(store_util, "_NUM_MEMBERS", "/members")  # a torch whose barrier differs
    assert exit_barrier.arrive_for_gone(workers, "job", list(range(5)), [0, 3], endpoint) == []
    assert not agents.check([counter])
    monkeypatch.undo()
    for name, value in (("MASTER_PORT", "4321"), ("GROUP_WORLD_SIZE", "4"), ("TORCHELASTIC_RUN_ID", "run")):
        monkeypatch.setenv(name, value)
    assert exit_barrier.arrive_for_gone(workers, "job", list(range(5)), [0, 3], endpoint) == [1, 2]
    assert agents.add(counter, 0) == 2
    # The next generation loses agent 3's workers: it arrives for 3, not again for 1 and 2.
    assert exit_barrier.arrive_for_gone(workers, "job", list(range(5)), [0], endpoint) == [3]
    assert not agents.check(["torchelastic/agent/terminal_state/last_member"])
    store_util._barrier_nonblocking(agents, 4, "torchelastic/agent/terminal_state")  # agent 0, as torch
    assert agents.check(["torchelastic/agent/terminal_state/last_member"])


def test_a_worker_lost_before_it_recorded_its_agent_is_placed_by_the_workers_per_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker lost before it wrote which agent runs it still counts for its agent: torchrun numbers
    workers agent by agent, LOCAL_WORLD_SIZE each, so the arrival for that agent is not skipped."""
    from commsched.elastic import exit_barrier

    server = _Store()
    for member in (0, 1, 2):  # 2 workers per agent; worker 3 (agent 1's second) recorded nothing
        monkeypatch.setenv("GROUP_RANK", str(member // 2))
        exit_barrier.record_agent(server.store, "job", member)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert exit_barrier.gone_agents(server.store, "job", [0, 1, 2, 3], [0, 1]) == [1]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert exit_barrier.gone_agents(server.store, "job", [0, 1, 2, 3], [0, 1]) == []  # not known: none
