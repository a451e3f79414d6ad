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


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """3 ranks over Gloo; the rank launched as 2 SIGKILLs itself after step() of step 3 in epoch 0."""
    out = tmp_path_factory.mktemp("gloo")
    done = launch(out, "-n", "3", "--min-np", "2", ELASTIC_KILL="2:0:3", COMMSCHED_TRANSPORT="gloo")
    return out, done


def check_elastic_run(out: Path, done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The job re-formed at 2 ranks and finished; each epoch saw every sample exactly once."""
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 2 (numbered as at launch" in done.stderr and "generation 1: 2 ranks" in done.stderr
    final = results(out)
    assert final["size"] == 2
    for epoch, seen in enumerate(final["seen"]):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples dropped or repeated"
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


def test_sigkill_grpc(gloo_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path) -> None:
    """Over gRPC the same fault re-forms the same way and ends at the same parameters (exact values)."""
    done = launch(tmp_path, "-n", "3", "--min-np", "2", ELASTIC_KILL="2:0:3", COMMSCHED_TRANSPORT="grpc")
    final = check_elastic_run(tmp_path, done)
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
    for epoch, seen in enumerate(final["seen"]):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {epoch}: samples dropped or repeated"


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

    for flags, words in (
        (["-n", "3", "--min-np", "4"], "--min-np (4) <= -n (3)"),
        (["-n", "3", "--min-np", "2", "--host-discovery-script", "x"], "adding hosts is not supported yet"),
    ):
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
