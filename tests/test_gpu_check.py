"""benchmarks/gpu_check.py --fake: two ranks under mpiexec on the fake CUDA/NCCL library. Every
correctness row must pass with a library whose sums cross processes, and a wrong sum (one rank's
inputs changed after the reference was fixed) must fail its rows and the run's exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpirun import clean_rank_env, mpiexec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check_worker as worker

needs_mpi = pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec and mpi4py")
# 12 dtype/op pairs, partitioned, fused, two dtypes at each of two stream places, and the
# further reductions and new-array collectives (allgather, reducescatter, alltoall)
ROWS = 74


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--fake", "--out", str(out), *args]
    done = subprocess.run(
        command, cwd=ROOT, env=clean_rank_env(ROOT), capture_output=True, text=True, timeout=170, check=False
    )
    assert out.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


@needs_mpi
def test_fake_run_passes_every_row(tmp_path: Path) -> None:
    """The fake's NCCL reduces across the two ranks: every correctness row passes and the run exits 0."""
    done, result = _run(tmp_path)
    rows = result["correctness"]
    assert len(rows) == ROWS and all(r["ranks"] == 2 for r in rows), rows
    failed = [r for r in rows if not r["passed"]]
    assert not failed, json.dumps(failed, indent=1)
    assert result["gpu_tests"]["passed"] and result["sweep"] and not result["training"]["ran"]
    assert done.returncode == 0, done.stdout[-3000:]


@needs_mpi
def test_a_wrong_sum_fails_its_rows_and_the_run(tmp_path: Path) -> None:
    """Rank 1 adds one to its inputs after the reference is fixed: every row reports wrong values and the
    exit status is non-zero."""
    done, result = _run(tmp_path, "--skip-tests", "--corrupt-rank", "1")
    rows = result["correctness"]
    assert len(rows) == ROWS, rows
    assert all(not r["passed"] and " wrong" in r["detail"] for r in rows), json.dumps(rows, indent=1)
    assert not result["passed"] and done.returncode == 1
    assert "FAIL" in done.stdout and "overall: FAIL" in done.stdout


def test_compare_finds_one_wrong_element_and_tolerates_only_rounding() -> None:
    """compare() is exact for sums and power-of-two averages, within rounding for other averages."""
    want = worker.expected("float32", "sum", 50, 2, salt=1)
    got = want.copy()
    assert worker.compare(got, want, "float32", "sum", 2) == ""
    got[17] += 1
    assert worker.compare(got, want, "float32", "sum", 2).startswith("1 of 50 wrong; [17]")
    third = worker.expected("bfloat16", "average", 50, 3, salt=2)
    rounded = third * (1 + 2.0**-9)
    assert worker.compare(rounded, third, "bfloat16", "average", 3) == ""
    assert worker.compare(third + 0.25, third, "bfloat16", "average", 3) != ""


def test_merge_fails_a_row_when_any_rank_failed() -> None:
    """A check passes only where every rank passed; the detail names the failing rank."""
    good = {"check": "allreduce", "passed": True, "detail": ""}
    bad = {"check": "allreduce", "passed": False, "detail": "3 of 9 wrong"}
    merged = worker.merge([[good, good], [good, bad]])
    assert merged[0]["passed"] and not merged[1]["passed"]
    assert merged[1]["detail"] == "rank 1: 3 of 9 wrong"


def test_step_time_dry_run_on_the_cpu(tmp_path: Path) -> None:
    """Section (e) on the CPU (--quick: tiny models, Gloo for DDP): every variant runs in a process of
    its own and reports its times, and commsched's launches per step; the compile'd model's losses in
    barrier mode equal eager's. GPT-2 is a skipped row where transformers is missing. ViT-B/16 runs the
    same worker code, so its tiny model is only built and stepped here, in this process."""
    import gpu_check
    import gpu_step_time
    import step_time_models
    import torch

    module, loss_of, _ = step_time_models.build("vit_b_16", True, torch.device("cpu"))
    loss = loss_of(module)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in module.parameters() if p.requires_grad)
    out = tmp_path / "gpu_step_time.json"
    result, printed = gpu_check.step_time(
        clean_rank_env(ROOT), out, "--device", "cpu", "--quick", "--jobs", "2", "--models", "resnet50,gpt2"
    )
    assert result["passed"], printed + json.dumps(result, indent=1)[-3000:]
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = {(r["model"], r["variant"]): r for r in result["rows"]}
    expected = [("resnet50", v) for v in gpu_step_time.VARIANTS]
    if gpu_step_time.missing("gpt2"):
        assert "transformers" in rows[("gpt2", None)]["skipped"]
    else:
        expected += [("gpt2", v) for v in gpu_step_time.VARIANTS]
    assert sorted(k for k in rows if k[1] is not None) == sorted(expected)
    for (model, variant), row in rows.items():
        if variant is None:
            continue
        assert len(row["ms"]) == 2 and row["min_ms"] <= row["median_ms"] <= row["max_ms"], row
        assert row["vs_ddp"] == pytest.approx(row["median_ms"] / rows[(model, "ddp")]["median_ms"])
        if variant in ("barrier", "overlap"):
            assert row["launches_per_step"] > 0 and row["fused_per_step"] >= 0, row
            assert row["launch_target"] == max(8.0, row["parameters"] / 16)
            assert isinstance(row["within_2pct_of_ddp"], bool) and isinstance(
                row["launches_within_target"], bool
            )
        else:
            assert "launches_per_step" not in row
    # The same model, seed and data under each variant: one rank's average is the gradient itself.
    for model in {m for m, v in rows if v is not None}:
        losses = {rows[(model, v)]["last_loss"] for v in gpu_step_time.VARIANTS}
        assert max(losses) - min(losses) < 1e-5, (model, losses)
    compiled = {r["mode"]: r for r in result["compile"]}
    assert compiled["barrier"]["judged"] and compiled["barrier"]["max_loss_difference"] <= 1e-5
    assert not compiled["overlap"]["judged"]
    lines = printed.splitlines()
    assert "median ms" in lines[1] and "vs DDP" in lines[1] and "launches/step" in lines[1]
    for label in gpu_step_time.LABELS.values():
        assert any(label in line for line in lines), printed
    assert sum(line.startswith("  torch.compile (aot_eager)") for line in lines) == 2, printed
    assert lines == gpu_step_time.table_lines(result) + [lines[-1]] and "step time: PASS" in lines[-1]


def test_replicas_have_torchvisions_parameter_tensors() -> None:
    """Without torchvision the step-time section builds ResNet-50 and ViT-B/16 itself, with the same
    parameter tensors (count and elements) as torchvision's models."""
    torch = pytest.importorskip("torch")
    import step_time_models

    with torch.device("meta"):  # shapes only: no 450 MB of weights to initialise
        resnet, vit = step_time_models.resnet50_replica(), step_time_models.vit_b_16_replica()
    for model, tensors, elements in ((resnet, 161, 25_557_032), (vit, 152, 86_567_656)):
        assert step_time_models.parameter_tensors(model) == tensors
        assert sum(p.numel() for p in model.parameters()) == elements


def test_step_time_refuses_workers_side_by_side_on_a_gpu() -> None:
    """Timings on one GPU are judged, so --jobs above 1 is a CPU dry run's option only, and says so."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_step_time.py"), "--device", "cuda", "--jobs", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2 and "--jobs 2" in done.stderr and "--device cpu" in done.stderr, done.stderr
