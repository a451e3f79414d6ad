"""Multi-rank runs of the core over MPI: randomized correctness, error paths, reconfiguration."""

from __future__ import annotations

import pytest
from mpirun import run_ranks

pytest.importorskip("mpi4py")


# 2 (a power of two) and 9 (odd, and more ranks than cores); 3 and 4 added no path these miss.
@pytest.mark.parametrize("ranks", [2, 9])
def test_random_collectives_match_numpy(ranks: int) -> None:
    """Thousands of random tensors per policy/setting, each rank in its own order, equal the numpy reference."""
    # Fewer on more ranks: this machine may have 2 cores. 9 ranks take the MPI exchange's
    # allgather path (up to 8, ranks send their reports to each other directly).
    tensors = {2: 1000, 3: 800, 4: 600, 9: 100}[ranks]
    result = run_ranks(ranks, "random_collectives.py", "--tensors", str(tensors), "--seed", str(ranks))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ALL OK") == ranks, result.stdout
    assert result.stdout.count("OK {'policy': 'fifo'}") == ranks


@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatched_tensor_fails_on_every_rank(ranks: int) -> None:
    """Different sizes under one name: every rank gets an error naming the tensor and the ranks."""
    result = run_ranks(ranks, "error_scenarios.py", "mismatch", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == ranks


@pytest.mark.parametrize("ranks", [2, 3])
def test_grouped_allreduce_of_another_length_fails_on_every_rank(ranks: int) -> None:
    """One rank passes fewer (or more) tensors to grouped_allreduce: every rank fails at once naming the lengths."""
    result = run_ranks(ranks, "error_scenarios.py", "grouped_lengths", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == ranks


def test_duplicate_in_flight_name_is_refused() -> None:
    """A name already in flight is refused at submission."""
    result = run_ranks(2, "error_scenarios.py", "duplicate", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == 2


def test_stall_warning_names_tensor_and_missing_rank() -> None:
    """A rank that submits late triggers a warning naming the tensor and the rank, then the job completes."""
    result = run_ranks(3, "error_scenarios.py", "stall", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == 3
    assert "'late' ready on ranks 0,2 but not on ranks 1" in result.stderr, result.stderr
    assert "(a hint given before init())" in result.stderr, result.stderr
    assert "COMMSCHED_STALL_TIMEOUT" in result.stderr


def test_stall_shutdown_stops_every_rank() -> None:
    """A rank that never submits makes every rank stop with a clear error instead of hanging."""
    result = run_ranks(3, "error_scenarios.py", "stall_shutdown", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == 3


def test_shutdown_fails_pending_handles() -> None:
    """shutdown() with a pending handle fails it; the other rank's runtime stops too."""
    result = run_ranks(2, "error_scenarios.py", "shutdown_pending", timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == 2


def test_reconfigure_switches_every_rank_together() -> None:
    """Settings change mid-run on all ranks at one cycle; integer results stay exact."""
    result = run_ranks(3, "error_scenarios.py", "reconfigure", timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == 3


@pytest.mark.parametrize(
    ("scenario", "ranks"), [("identical", 3), ("mixed", 2), ("budget", 2), ("threads", 2), ("late", 2)]
)
def test_inline_payloads_and_waiting_callers(scenario: str, ranks: int) -> None:
    """Small tensors reduced inline in the agreement round, and callers that run the core while waiting."""
    result = run_ranks(ranks, "inline_and_callers.py", scenario, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SCENARIO-OK") == ranks, result.stdout + result.stderr
