"""Builds and runs the C++ tests of the scheduling logic (no transport), under ASan and UBSan."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = [
    ROOT / "csrc" / "core" / f"{name}.cc"
    for name in (
        "types",
        "elementwise",
        "host_copy",
        "scheduler",
        "agreement",
        "agreement_report",
        "agreement_membership",
    )
] + [
    ROOT / "csrc" / "transport" / "control" / f"{name}.cc"
    for name in ("control_wire", "host_identity", "tcp_control_channel")
]
TESTS = sorted((ROOT / "tests" / "cpp").glob("*.cc"))
FLAGS = [
    "-std=c++17",
    # -Og, not -O1: the sanitizers check the same at either, and -Og keeps the flow analysis that
    # -Wmaybe-uninitialized needs, while compiling in about half the time (28 s against 51 s, serial).
    "-Og",
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
    objects = [build / f"{source.parent.name}_{source.stem}.o" for source in CORE + TESTS]

    def compile_one(source: Path, obj: Path) -> subprocess.CompletedProcess[str]:
        command = ["g++", *FLAGS, "-c", str(source), "-o", str(obj)]
        return subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)

    # The biggest sources first, and each worker takes the next file as soon as it is free, so no CPU
    # idles while one long file finishes last.
    order = sorted(zip(CORE + TESTS, objects), key=lambda pair: -pair[0].stat().st_size)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        done = list(pool.map(lambda pair: compile_one(*pair), order))
    failed = [f"{r.args[-3]}:\n{r.stderr}" for r in done if r.returncode != 0]
    assert not failed, "compilation failed: " + "\n".join(failed)
    binary = build / "core_tests"
    subprocess.run(["g++", *FLAGS, *map(str, objects), "-o", str(binary)], check=True)
    return binary


def test_cpp_suites(test_binary: Path) -> None:
    """Every case prints PASS/FAIL; the binary exits non-zero on any failure."""
    result = subprocess.run([str(test_binary)], check=False, capture_output=True, text=True, timeout=300)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 failed" in result.stdout and result.stdout.count("PASS ") >= 37
