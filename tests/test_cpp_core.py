"""Builds and runs the C++ tests of the scheduling logic (no transport), under ASan and UBSan."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = [
    ROOT / "csrc" / "core" / f"{name}.cc"
    for name in ("types", "elementwise", "scheduler", "agreement", "agreement_report", "agreement_membership")
] + [
    ROOT / "csrc" / "transport" / "control" / f"{name}.cc"
    for name in ("control_wire", "host_identity", "tcp_control_channel")
]
TESTS = sorted((ROOT / "tests" / "cpp").glob("*.cc"))
FLAGS = [
    "-std=c++17",
    "-O1",
    "-g",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=undefined",
    f"-I{ROOT / 'csrc'}",
    f"-I{ROOT / 'tests' / 'cpp'}",
]


@pytest.fixture(scope="module")
def test_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Compiles core and test sources in parallel, then links one test binary."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to build the C++ tests")
    build = tmp_path_factory.mktemp("cpp")
    objects, jobs = [], []
    for source in CORE + TESTS:
        obj = build / f"{source.parent.name}_{source.stem}.o"
        objects.append(obj)
        jobs.append(subprocess.Popen(["g++", *FLAGS, "-c", str(source), "-o", str(obj)]))
        if len(jobs) >= (os.cpu_count() or 2):
            assert jobs.pop(0).wait() == 0, "compilation failed"
    assert all(job.wait() == 0 for job in jobs), "compilation failed"
    binary = build / "core_tests"
    subprocess.run(["g++", *FLAGS, *map(str, objects), "-o", str(binary)], check=True)
    return binary


def test_cpp_suites(test_binary: Path) -> None:
    """Every case prints PASS/FAIL; the binary exits non-zero on any failure."""
    result = subprocess.run([str(test_binary)], check=False, capture_output=True, text=True, timeout=300)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout and result.stdout.count("PASS ") >= 37
