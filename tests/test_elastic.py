"""Elastic training under commsched-run --min-np: a SIGKILLed rank costs the others a re-forming, not
the job. The survivors restore the last commit, re-form at 2 ranks (Gloo and gRPC) and end with the
parameters of a run started at 2 ranks from that commit; the ElasticSampler neither drops nor repeats
a sample across the resize; below --min-np the job ends naming the lost rank. The membership service
and the launcher checks are exercised in-process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from commsched.elastic import membership

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "elastic_ranks" / "train.py"
SAMPLES = 48  # as in the rank script
LAUNCH_TIMEOUT_S = 90
# A wrong turn in a growth test fails in seconds, not after the default stall limits.
FAST_FAILURE = {"COMMSCHED_STALL_TIMEOUT": "15", "COMMSCHED_STALL_SHUTDOWN": "20"}


def launch(out: Path, *flags: str, **environment: str) -> subprocess.CompletedProcess[str]:
    """commsched-run with `flags` over the rank script, results in `out`; never waits past the timeout."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")
    }
    env.update(ELASTIC_OUT=str(out), **environment)
    command = [sys.executable, "-m", "commsched.run", *flags, str(SCRIPT)]
    return subprocess.run(
        command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False
    )


def results(out: Path) -> dict[str, Any]:
    return torch.load(out / "final.pt", weights_only=False)


def assert_every_sample_once(final: dict[str, Any]) -> None:
    """Each epoch of the run saw every sample exactly once, across every resize."""
    for epoch, seen in enumerate(final["seen"]):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples dropped or repeated"


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """3 ranks over Gloo; the rank launched as 2 SIGKILLs itself after step() of step 3 in epoch 0. Its
    commit thread starts each capture 0.3 s late, as on a loaded host: its part of the 4-element
    weight is empty, and its commits must count without that thread."""
    out = tmp_path_factory.mktemp("gloo")
    done = launch(
        out,
        "-n",
        "3",
        "--min-np",
        "2",
        ELASTIC_KILL="2:0:3",
        ELASTIC_SLOW_COMMIT="2:0.3",
        COMMSCHED_TRANSPORT="gloo",
    )
    return out, done


def check_elastic_run(out: Path, done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The job re-formed at 2 ranks and finished; each epoch saw every sample exactly once."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 2 (numbered as at launch" in done.stderr and "generation 1: 2 ranks" in done.stderr
    final = results(out)
    assert final["size"] == 2
    assert_every_sample_once(final)
    return final


def test_sigkill_gloo_equals_a_run_started_from_the_commit(
    gloo_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """The survivors' final parameters equal those of a fresh 2-rank run from the restored commit."""
    out, done = gloo_run
    final = check_elastic_run(out, done)
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 3 * 2}  # 3 commits of 3 ranks x 2
    reference = launch(
        tmp_path, "-n", "2", ELASTIC_START=str(out / "restored.pt"), COMMSCHED_TRANSPORT="gloo"
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = results(tmp_path)
    assert torch.count_nonzero(expected["weight"]) > 0
    assert torch.equal(final["weight"], expected["weight"])
    assert final["seen"] == expected["seen"]


def test_sigkill_grpc_overlap(
    gloo_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    """Over gRPC, in overlap_forward mode, the same fault re-forms the same way and ends at the same
    parameters (exact values): after the restore every update still lands before the next forward.
    A survivor's commit thread is starved (rank 1's captures start 0.3 s late): overlap mode defers
    the update that would have copied its part, so rank 0 decides about the last commit while rank 1
    still copies it, and must wait for that part rather than go back one commit more (12 samples
    instead of 18)."""
    done = launch(
        tmp_path,
        "-n",
        "3",
        "--min-np",
        "2",
        ELASTIC_KILL="2:0:3",
        ELASTIC_OVERLAP="1",
        ELASTIC_SLOW_COMMIT="1:0.3",
        COMMSCHED_TRANSPORT="grpc",
    )
    final = check_elastic_run(tmp_path, done)
    restored = torch.load(tmp_path / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 3 * 2}
    assert torch.equal(final["weight"], results(gloo_run[0])["weight"])


def test_a_rank_lost_while_reforming_makes_the_others_reform_again(tmp_path: Path) -> None:
    """4 ranks, --min-np 2: rank 3 dies in training, rank 2 in the reset callback of the re-forming;
    the last two re-form again and finish, every sample seen once per epoch."""
    done = launch(
        tmp_path, "-n", "4", "--min-np", "2", ELASTIC_KILL="3:0:2,2:-1:-1", COMMSCHED_TRANSPORT="gloo"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 3 ranks" in done.stderr and "generation 2: 2 ranks" in done.stderr, done.stderr
    final = results(tmp_path)
    assert final["size"] == 2
    assert_every_sample_once(final)


def test_below_min_np_ends_the_job_naming_the_rank(tmp_path: Path) -> None:
    """With --min-np 2 of 2 ranks, losing one ends the job with an error naming it."""
    started = time.monotonic()
    done = launch(tmp_path, "-n", "2", "--min-np", "2", ELASTIC_KILL="1:0:2", COMMSCHED_TRANSPORT="gloo")
    assert done.returncode == 1
    assert "rank 1 (numbered as at launch) failed; 1 rank is left, below --min-np 2" in done.stderr, (
        done.stderr
    )
    assert not (tmp_path / "final.pt").exists()
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("fault", "ranks", "transport", "generations"),
    [
        # Stopped in backward: its gradient never leaves; the others' stall limit ends the step and the
        # launcher kills the rank that did not rejoin within the window.
        ({"ELASTIC_STOP": "2:0:2:backward"}, 3, "gloo", [2]),
        # Killed in commit(), while the capture of its model runs in the background.
        ({"ELASTIC_KILL": "2:1:1:commit"}, 3, "grpc", [2]),
        # A second rank killed as the state sync after the first re-forming starts.
        ({"ELASTIC_KILL": "3:0:2,2:-1:-1:sync"}, 4, "gloo", [3, 2]),
    ],
    ids=["stop-in-backward", "kill-in-commit", "kill-in-sync"],
)
def test_faults_inside_backward_commit_and_sync(
    fault: dict[str, str], ranks: int, transport: str, generations: list[int], tmp_path: Path
) -> None:
    """Wherever the fault strikes, the others re-form, finish at the smaller size and see every
    sample once per epoch."""
    done = launch(
        tmp_path,
        "-n",
        str(ranks),
        "--min-np",
        "2",
        "--elastic-timeout",
        "3",
        COMMSCHED_TRANSPORT=transport,
        COMMSCHED_STALL_TIMEOUT="1",
        COMMSCHED_STALL_SHUTDOWN="3",
        **fault,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for generation, size in enumerate(generations, start=1):
        assert f"generation {generation}: {size} ranks" in done.stderr, done.stderr[-3000:]
    final = results(tmp_path)
    assert final["size"] == 2
    assert_every_sample_once(final)


def _server(members: list[int], alive: set[int], min_np: int, window_s: float) -> tuple[Any, list[Any]]:
    evicted: list[Any] = []
    server = membership.MembershipServer(
        members=members,
        port=1,
        min_np=min_np,
        max_np=len(members),
        join_window_s=window_s,
        alive=lambda: alive,
        evict=lambda ranks, why: evicted.append((ranks, why)),
        pick_port=lambda: 4242,
    )
    return server, evicted


def _ask(server: Any, member: int, generation: int = 0) -> Any:
    try:
        return membership.request(server.address, member, generation, wait_s=10.0)
    except membership.MembershipError as error:
        return error


def test_membership_keeps_rank_order_and_evicts_a_silent_rank() -> None:
    """Survivors keep their order (the lowest becomes rank 0); a live rank that never asks is evicted."""
    from concurrent.futures import ThreadPoolExecutor

    server, evicted = _server([0, 1, 2, 3], alive={1, 2, 3}, min_np=2, window_s=0.5)
    try:
        with ThreadPoolExecutor(2) as pool:  # rank 2 is "stopped": alive but silent
            answers = list(pool.map(lambda member: _ask(server, member), [3, 1]))
        assert [(a.rank, a.size, a.port, a.generation) for a in answers] == [(1, 2, 4242, 1), (0, 2, 4242, 1)]
        assert evicted and evicted[0][0] == [2]
        late = _ask(server, 2)
        assert isinstance(late, membership.MembershipError) and "not in generation 1" in str(late)
    finally:
        server.close()


def test_membership_below_min_np_names_the_lost_ranks() -> None:
    """Fewer survivors than --min-np: every asking rank gets the error, which names the lost ranks."""
    server, _ = _server([0, 1, 2], alive={0}, min_np=2, window_s=5.0)
    try:
        answer = _ask(server, 0)
        assert isinstance(answer, membership.MembershipError)
        assert "ranks 1, 2 (numbered as at launch) failed; 1 rank is left, below --min-np 2" in str(answer)
        assert server.failure == str(answer)
    finally:
        server.close()


def test_elastic_api_is_an_attribute_as_in_horovod() -> None:
    """Horovod's elastic examples use hvd.elastic.run and hvd.elastic.TorchState after only
    `import horovod.torch as hvd`: the same names answer after `import commsched.torch as hvd`."""
    code = (
        "import commsched.torch as hvd\n"
        "print(hvd.elastic.run.__module__, hvd.elastic.TorchState.__name__, hvd.elastic.ElasticSampler.__name__)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["commsched.torch.elastic", "TorchState", "ElasticSampler"], done.stdout


def test_run_under_mpiexec_says_membership_is_fixed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Under mpiexec, elastic.run says at start that MPI keeps its ranks and names commsched-run."""
    from commsched import elastic

    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    monkeypatch.delenv(membership.ADDRESS_VARIABLE, raising=False)
    monkeypatch.setattr(elastic, "_membership", elastic._Membership())
    assert elastic._check_launcher() is False
    message = capsys.readouterr().err
    assert "MPI keeps the ranks it started" in message and "commsched-run -n N --min-np" in message


def test_launcher_refuses_elastic_flags_that_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad elastic flags are refused naming the fix."""
    from commsched import run

    for flags, words in ((["-n", "3", "--min-np", "4"], "--min-np (4) <= -n (3)"),):
        with pytest.raises(SystemExit):
            run.main([*flags, "script.py"])
        assert words in capsys.readouterr().err


def test_sampler_reshards_the_rest_without_loss_or_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """ElasticSampler: after 2 steps at 3 ranks, the rest split over 2 ranks covers every sample once."""
    from commsched.torch.elastic import ElasticSampler

    import commsched

    def as_rank(rank: int, size: int) -> None:
        monkeypatch.setattr(commsched, "is_initialized", lambda: True)
        monkeypatch.setattr(commsched, "rank", lambda: rank)
        monkeypatch.setattr(commsched, "size", lambda: size)

    seen: list[int] = []
    for rank in range(3):
        as_rank(rank, 3)
        sampler = ElasticSampler(range(30), seed=5)
        seen += list(sampler)[:4]  # 2 steps of batch 2
        sampler.record_batch(0, 2)
        sampler.record_batch(1, 2)
    state = sampler.state_dict()
    assert state == {"epoch": 0, "processed_num": 12}
    for rank in range(2):
        as_rank(rank, 2)
        sampler = ElasticSampler(range(30), seed=5)
        sampler.load_state_dict(state)
        assert len(sampler) == 9
        seen += list(sampler)
    assert sorted(seen) == list(range(30))
    sampler.set_epoch(1)
    assert sampler.state_dict() == {"epoch": 1, "processed_num": 0} and len(sampler) == 15


def _discovery(tmp_path: Path, body: str) -> Path:
    """A discovery script (a shell script with `body`) in tmp_path."""
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    return script


def test_discovery_script_errors_name_the_script_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that prints garbage, fails, names another machine or gives too few slots is refused
    at start, naming the script (and the line)."""
    from commsched import run

    for body, words in (
        ("echo localhost:2; echo 'localhost:two'", "line 2 ('localhost:two'): expected `hostname:slots`"),
        ("echo oops >&2; exit 3", "exited with status 3 (oops)"),
        ("echo gpu-node-7:4", "line 1 ('gpu-node-7:4'): host gpu-node-7 is not this machine"),
        ("echo 127.0.0.1:1", "gives 1 slots on this host; -n 2 needs at least as many"),
    ):
        script = _discovery(tmp_path, body)
        with pytest.raises(SystemExit):
            run.main(["-n", "2", "--max-np", "3", "--host-discovery-script", str(script), "script.py"])
        error = capsys.readouterr().err
        assert str(script) in error and words in error, error


def grow_2_to_3(tmp_path: Path, **environment: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """2 ranks over Gloo, the discovery script edited to 3 slots in step 2: a third rank joins there."""
    out = tmp_path / "grown"
    script = _discovery(tmp_path, "echo localhost:2")
    flags = ("-n", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script))
    done = launch(
        out,
        *flags,
        ELASTIC_GROW="0:2:3",  # 36 samples left: 12 per rank, no padding
        ELASTIC_SCRIPT=str(script),
        **FAST_FAILURE,
        COMMSCHED_TRANSPORT="gloo",
        **environment,
    )
    return out, done


def check_grown(out: Path, done: subprocess.CompletedProcess[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The job grew to 3 at the step-2 commit and saw every sample once; its final and restored state."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 3 ranks (no rank, numbered as at launch, lost; rank 2 joining)" in done.stderr
    final = results(out)
    assert final["size"] == 3
    assert_every_sample_once(final)
    restored = torch.load(out / "restored.pt", weights_only=False)
    assert restored["sampler"] == {"epoch": 0, "processed_num": 3 * 2 * 2}  # 3 commits of 2 ranks x 2
    return final, restored


def test_grow_2_to_3_through_the_discovery_script(tmp_path: Path) -> None:
    """2 ranks, the script edited to 3 slots in step 2: a third rank joins at that commit and gets the
    state from rank 0; the end equals a 3-rank run from that commit, every sample seen once per epoch."""
    out, done = grow_2_to_3(tmp_path)
    final, _ = check_grown(out, done)
    reference = launch(
        tmp_path / "reference", "-n", "3", ELASTIC_START=str(out / "restored.pt"), COMMSCHED_TRANSPORT="gloo"
    )
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = results(tmp_path / "reference")
    assert torch.count_nonzero(expected["weight"]) > 0
    assert torch.equal(final["weight"], expected["weight"])
    assert final["seen"] == expected["seen"]


def test_a_killed_rank_is_replaced_from_the_free_slot(tmp_path: Path) -> None:
    """3 slots, 3 ranks: rank 2 is SIGKILLed, the others re-form at 2, then the launcher starts a new
    rank in the freed slot and it joins; the job ends at 3 ranks, every sample seen once per epoch.
    In overlap_forward mode: the restore and the re-forming for the join each replace the reducer."""
    script = _discovery(tmp_path, "echo localhost:3")
    done = launch(
        tmp_path,
        *("-n", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script)),
        ELASTIC_KILL="2:0:3",
        ELASTIC_GROW="1:2:3",  # rank 0 waits there for the new rank if it has not joined yet
        ELASTIC_SCRIPT=str(script),
        ELASTIC_OVERLAP="1",
        COMMSCHED_TRANSPORT="gloo",
        **FAST_FAILURE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "generation 1: 2 ranks" in done.stderr, done.stderr
    assert "generation 2: 3 ranks (no rank, numbered as at launch, lost; rank 3 joining)" in done.stderr
    final = results(tmp_path)
    assert final["size"] == 3
    for epoch, seen in enumerate(final["seen"]):
        # Where the join lands depends on the launcher's poll: the rest may not split evenly over 3, and
        # the sampler then pads with up to 2 repeats, as DistributedSampler does.
        assert set(seen) == set(range(SAMPLES)) and len(seen) - SAMPLES < 3, f"epoch {epoch}: {sorted(seen)}"


def test_slots_removed_from_the_script_stop_ranks_and_the_others_go_on(tmp_path: Path) -> None:
    """3 ranks, the script cut to 2 slots in step 3: the newest rank is stopped, the others restore
    the last commit, re-form at 2 and finish, every sample seen once per epoch."""
    script = _discovery(tmp_path, "echo localhost:3")
    done = launch(
        tmp_path,
        *("-n", "3", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(script)),
        ELASTIC_GROW="0:3:2",  # rank 0 waits there until the launcher stopped rank 2
        ELASTIC_SCRIPT=str(script),
        COMMSCHED_TRANSPORT="gloo",
        **FAST_FAILURE,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 2 (numbered as at launch) is past the 2 slots the discovery script gives now" in done.stderr
    assert "generation 1: 2 ranks" in done.stderr, done.stderr
    final = results(tmp_path)
    assert final["size"] == 2
    assert_every_sample_once(final)
