"""Builds and runs the C++ tests of the scheduling logic (no transport), under ASan and UBSan."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE_SOURCES = [ROOT / "csrc" / "core" / f"{name}.cc" for name in ("types", "elementwise", "scheduler", "agreement")]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed to build the C++ tests")
@pytest.mark.parametrize("suite", ["scheduler", "agreement", "elementwise"])
def test_cpp_suite(suite: str, tmp_path: Path) -> None:
    """Each suite prints PASS/FAIL per case and exits non-zero on any failure."""
    binary = tmp_path / f"test_{suite}"
    sources = [str(ROOT / "tests" / "cpp" / f"test_{suite}.cc"), *map(str, CORE_SOURCES)]
    flags = ["-std=c++17", "-O1", "-g", "-Wall", "-Wextra", "-Werror", *SANITIZERS]
    includes = [f"-I{ROOT / 'csrc'}", f"-I{ROOT / 'tests' / 'cpp'}"]
    subprocess.run(["g++", *flags, *includes, *sources, "-o", str(binary)], check=True)
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout
