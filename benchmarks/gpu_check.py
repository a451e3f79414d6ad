"""Checks commsched's GPU path on one machine and reports a table plus JSON (scripts/gpu_check.sh runs it).

    python benchmarks/gpu_check.py                # one NVIDIA GPU: PyTorch with CUDA, NCCL (CuPy optional)
    python benchmarks/gpu_check.py --fake         # no GPU: tests/fake_cuda.py's library, 2 ranks (mpiexec)

Sections: (a) the tests that need a GPU (pytest; they skip without one), (b) correctness through
commsched of every dtype and op, a partitioned and a fused case, and tensors written late on a side
stream and on the per-thread default stream, each compared exactly with a host reference, (c) time
per allreduce from 4 B up through commsched and through raw NCCL on the same device, (d) a CUDA
training run of examples/torch_train.py, and (e) training step time of ResNet-50, ViT-B/16 and
GPT-2 without communication, under DDP and under commsched's two modes, plus a torch.compile'd
model trained through commsched (benchmarks/gpu_step_time.py; its JSON goes beside --out's).
Exit status 0 only when every check passed; the timings are reported, never judged.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from xml.etree import ElementTree

import gpu_step_time  # beside this file: the script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "gpu_check_worker.py"
STEP_TIME = ROOT / "benchmarks" / "gpu_step_time.py"
# The tests that need a GPU; each skips without one.
GPU_TESTS = (
    "tests/test_torch_cuda.py",
    "tests/test_torch_cuda_state.py",
    "tests/test_nccl.py::test_nccl_on_the_real_gpu_or_skip",
    "tests/test_nccl.py::test_commsched_on_the_real_gpu_or_skip",
)
# The launch path's targets at one rank with the defaults: small collectives cost at most a few
# microseconds more than raw NCCL, large ones at most 10% more.
SWEEP_EXTRA_US = 5.0
SWEEP_RATIO = 1.1
FAKE_LARGEST = 4 << 20  # the fake's sweep stops at 4 MiB: host memcpy speed says nothing about NCCL


def _environment(fake: bool) -> dict[str, Any]:
    """Versions of what the run depends on (distribution metadata: nothing heavy is imported)."""
    found: dict[str, Any] = {"python": platform.python_version(), "fake": fake}
    for package in ("torch", "cupy-cuda12x", "cupy-cuda11x", "cupy", "nvidia-nccl-cu12", "nvidia-nccl-cu13"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    if not fake:
        probe = "import torch; print(torch.cuda.get_device_name(0)); print(torch.cuda.nccl.version())"
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=False)
        lines = done.stdout.split("\n")
        found["gpu"] = lines[0] if done.returncode == 0 else f"unavailable: {done.stderr.strip()[-300:]}"
        found["torch_nccl"] = lines[1] if done.returncode == 0 and len(lines) > 1 else None
    return found


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    """This environment without a surrounding job's launcher and commsched variables, plus `extra`."""
    prefixes = ("COMMSCHED_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    return {**env, **extra}


def gpu_tests(env: dict[str, str], folder: Path, fake: bool) -> dict[str, Any]:
    """(a) pytest of GPU_TESTS, one row per test from its JUnit report."""
    report = folder / "gpu_tests.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        *GPU_TESTS,
    ]
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=900
    )
    rows: list[dict[str, str]] = []
    if report.exists():
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            outcome, detail = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    detail = (child.get("message") or "").strip().split("\n")[0][:200]
            rows.append(
                {"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome, "detail": detail}
            )
    counts = {o: sum(r["outcome"] == o for r in rows) for o in ("passed", "failed", "error", "skipped")}
    # With a GPU, a skip means something the tests need is missing; without one, skipping is their job.
    passed = done.returncode in (0, 5) and bool(rows) and not counts["failed"] and not counts["error"]
    if not fake and counts["skipped"]:
        passed = False
    if not rows:
        rows.append({"test": "pytest", "outcome": "error", "detail": (done.stdout + done.stderr)[-500:]})
    return {"command": " ".join(command[2:]), "counts": counts, "passed": passed, "rows": rows}


def _mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def worker(
    env: dict[str, str], folder: Path, fake: bool, ranks: int, corrupt_rank: int | None, largest: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """(b) and (c): runs gpu_check_worker.py (under mpiexec with the fake); returns (correctness, sweep, problem)."""
    out = folder / "worker.json"
    command = [str(WORKER), "--out", str(out), "--largest", str(largest)]
    if fake:
        command.append("--fake")
    if corrupt_rank is not None:
        command += ["--corrupt-rank", str(corrupt_rank)]
    if fake and ranks > 1:
        launcher = _mpiexec()
        if launcher is None:
            return [], [], "--fake needs mpiexec (pip install mpich mpi4py) for its ranks"
        command = [launcher, "-n", str(ranks), sys.executable, "-m", "mpi4py", *command]
    else:
        command = [sys.executable, *command]
    env = {**env, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600
        )
    except subprocess.TimeoutExpired as error:
        return [], [], f"the worker did not finish within {error.timeout}s"
    sys.stderr.write(done.stderr[-4000:] if done.returncode else "")
    if done.returncode != 0 or not out.exists():
        return [], [], f"worker exited {done.returncode}: {(done.stdout + done.stderr)[-800:]}"
    result = json.loads(out.read_text())
    return result["correctness"], result["sweep"], ""


def training(env: dict[str, str], epochs: int) -> dict[str, Any]:
    """(d) examples/torch_train.py on the GPU: the loss must fall and commsched must have launched."""
    command = [
        sys.executable,
        str(ROOT / "examples" / "torch_train.py"),
        "--device",
        "cuda",
        "--epochs",
        str(epochs),
    ]
    if importlib.util.find_spec("sklearn") is None:
        command += ["--data", "synthetic"]
    started = time.perf_counter()
    done = subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=600
    )
    output = done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", output)]
    launches = re.search(r"commsched: (\d+) launches, (\d+) fused", output)
    header = re.search(r"rank\(s\) on (\S+), (\S+),", output)
    result: dict[str, Any] = {
        "ran": True,
        "command": " ".join(command[1:]),
        "seconds": round(time.perf_counter() - started, 1),
        "losses": losses,
        "launches": int(launches.group(1)) if launches else 0,
        "fused_launches": int(launches.group(2)) if launches else 0,
        "transport": header.group(2) if header else None,
    }
    problems = []
    if done.returncode != 0:
        problems.append(f"exited {done.returncode}: {output[-600:]}")
    if len(losses) < 2 or not losses[-1] < losses[0]:
        problems.append(f"loss did not decrease: {losses}")
    if result["launches"] <= 0:
        problems.append("commsched launched nothing")
    if result["transport"] != "nccl":
        problems.append(f"transport {result['transport']!r}, expected nccl")
    result.update(passed=not problems, detail="; ".join(problems))
    return result


def step_time(env: dict[str, str], out: Path, *options: str) -> tuple[dict[str, Any], str]:
    """(e) gpu_step_time.py, one process per variant; returns (its JSON, its table as printed)."""
    command = [sys.executable, str(STEP_TIME), "--out", str(out), *options]
    out.unlink(missing_ok=True)  # a JSON left by an earlier run must not pass for this one's
    try:
        # stderr passes through: one progress line per variant while the section runs.
        done = subprocess.run(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=False, timeout=3600
        )
    except subprocess.TimeoutExpired as error:
        problem = f"did not finish within {error.timeout}s"
        return {"ran": True, "passed": False, "problem": problem, "rows": [], "compile": []}, ""
    if not out.exists():
        problem = f"exited {done.returncode} without writing {out}: {done.stdout[-800:]}"
        return {"ran": True, "passed": False, "problem": problem, "rows": [], "compile": []}, done.stdout
    return {"ran": True, "command": " ".join(command[1:]), **json.loads(out.read_text())}, done.stdout


def _fake_library(folder: Path) -> dict[str, str]:
    """Builds tests/fake_cuda.py's library; the variables that make commsched load it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_cuda

    library = fake_cuda.build(folder)
    if library is None:
        raise SystemExit("--fake needs a C compiler (cc or gcc) to build tests/fake_cuda.py's library")
    return {"COMMSCHED_NCCL_LIBRARY": str(library), "COMMSCHED_CUDART_LIBRARY": str(library)}


MARK = {True: "PASS", False: "FAIL"}


def print_tests(result: dict[str, Any]) -> None:
    """Section (a) as text, one line per test."""
    tests = result["gpu_tests"]
    if tests["command"] is None:
        print("\n(a) GPU tests: left out (--skip-tests)")
    else:
        print(f"\n(a) GPU tests: {tests['counts']}  [{MARK[tests['passed']]}]")
    for row in tests["rows"]:
        print(f"  {row['outcome'].upper():8} {row['test']}  {row['detail']}")


def print_worker(result: dict[str, Any]) -> None:
    """Sections (b) and (c) as text: one line per check, one per sweep size."""
    ranks = result["correctness"][0]["ranks"] if result["correctness"] else "?"
    print(f"\n(b) correctness through commsched ({ranks} rank(s), {result['mode']})")
    print(f"  {'':4} {'check':40} {'dtype':9} {'op':8} {'elements':>8}  place / detail")
    for row in result["correctness"]:
        tail = row["place"] + (f"  -- {row['detail']}" if row["detail"] else "")
        line = f"  {MARK[row['passed']]} {row['check']:40} {row['dtype']:9} {row['op']:8} {row['elements']:>8}  {tail}"
        print(line)
    if result["worker_problem"]:
        print(f"  FAIL {result['worker_problem']}")
    raw = result["sweep"][0]["raw"] if result["sweep"] else "raw NCCL"
    settings = result["sweep"][0].get("settings") if result["sweep"] else None
    under = f", commsched's settings {settings}" if settings else ""
    print(f"\n(c) time per allreduce (float32), commsched vs {raw}{under}")
    print(f"  {'bytes':>11} {'commsched us':>13} {'raw us':>10} {'ratio':>7} {'iters':>6}  target")
    for row in result["sweep"]:
        ratio = f"{row['ratio']:.2f}" if row["ratio"] is not None else "-"
        print(
            f"  {row['bytes']:>11} {row['commsched_us']:>13.1f} {row['raw_us']:>10.1f} {ratio:>7} "
            f"{row['iterations']:>6}  {_sweep_target(row)}"
        )
    print("  targets (reported, never judged): raw + 5 us up to 4 MiB, 1.1x raw from 16 MiB")


def print_training(result: dict[str, Any]) -> None:
    """Section (d) as text."""
    run = result["training"]
    if run["ran"]:
        print(
            f"\n(d) training: losses {run['losses']}, {run['launches']} launches  [{MARK[run['passed']]}] {run['detail']}"
        )
    else:
        print(f"\n(d) training: skipped ({run['reason']})")


def print_step_time(result: dict[str, Any]) -> None:
    """Section (e) as text: gpu_step_time.py's table."""
    timed = result["step_time"]
    if not timed["ran"]:
        print(f"\n(e) step time: skipped ({timed['reason']})")
    elif timed.get("problem"):
        print(f"\n(e) step time: [FAIL] {timed['problem']}")
    else:
        print(f"\n(e) step time  [{MARK[timed['passed']]}]")
        print("\n".join(f"  {line}" for line in gpu_step_time.table_lines(timed)))


def _sweep_target(row: dict[str, Any]) -> str:
    """The sweep row against its target: raw + 5 us up to 4 MiB, 1.1x raw above."""
    if row["bytes"] <= 4 << 20:
        met = row["commsched_us"] <= row["raw_us"] + SWEEP_EXTRA_US
        return f"<= raw + {SWEEP_EXTRA_US:g} us {'met' if met else 'MISSED'}"
    met = row["ratio"] is not None and row["ratio"] <= SWEEP_RATIO
    return f"<= {SWEEP_RATIO:g}x raw {'met' if met else 'MISSED'}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--fake", action="store_true", help="no GPU: the fake CUDA/NCCL library, several ranks"
    )
    parser.add_argument("--out", default="out/gpu_check.json", help="where the JSON goes")
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the --fake correctness run (mpiexec)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of the training run")
    parser.add_argument("--skip-tests", action="store_true", help="leave out (a), the pytest section")
    parser.add_argument("--skip-step-time", action="store_true", help="leave out (e), the step-time section")
    parser.add_argument(
        "--corrupt-rank",
        type=int,
        default=None,
        help="this rank adds one to its inputs after the reference is fixed: every check must then fail",
    )
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as scratch:
        folder = Path(scratch)
        env = _clean_env(_fake_library(folder) if args.fake else {})
        result: dict[str, Any] = {
            "mode": "fake" if args.fake else "gpu",
            "environment": _environment(args.fake),
        }
        # Each section is printed and the JSON written as soon as it ends: a run cut short (a GPU
        # lent for minutes) keeps what it finished.
        out.parent.mkdir(parents=True, exist_ok=True)
        result["complete"] = False
        if args.skip_tests:
            result["gpu_tests"] = {"command": None, "counts": {}, "passed": True, "rows": []}
        else:
            result["gpu_tests"] = gpu_tests(env, folder, args.fake)
        _progress(result, out, print_tests)
        largest = FAKE_LARGEST if args.fake else 256 << 20
        ranks = args.ranks if args.fake else 1
        rows, timings, problem = worker(env, folder, args.fake, ranks, args.corrupt_rank, largest)
        result.update(correctness=rows, sweep=timings, worker_problem=problem)
        _progress(result, out, print_worker)
        if args.fake:
            reason = "--fake: the fake library is not a GPU PyTorch can train on"
            result["training"] = {"ran": False, "passed": True, "reason": reason}
        else:
            result["training"] = training(env, args.epochs)
        _progress(result, out, print_training)
        if args.fake or args.skip_step_time:
            reason = "--skip-step-time" if args.skip_step_time else "--fake: no GPU to time training on"
            result["step_time"] = {"ran": False, "passed": True, "reason": reason}
        else:
            result["step_time"], _ = step_time(env, out.with_name("gpu_step_time.json"))
        _progress(result, out, print_step_time)
    result["passed"] = bool(
        rows
        and not problem
        and all(r["passed"] for r in rows)
        and result["gpu_tests"]["passed"]
        and result["training"]["passed"]
        and result["step_time"]["passed"]
    )
    result["out"] = str(out)
    result["complete"] = True
    out.write_text(json.dumps(result, indent=1))
    print(f"\noverall: {MARK[result['passed']]}  (JSON: {result['out']})")
    return 0 if result["passed"] else 1


def _progress(result: dict[str, Any], out: Path, show: Any) -> None:
    """Prints the section just finished and writes the JSON so far."""
    show(result)
    sys.stdout.flush()
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    sys.exit(main())
