"""What a new installation shows: commsched-info's report, the source-tree trap's message, and the
message for a missing TensorFlow."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    """The environment without PYTHONPATH, so only the installed (editable) commsched is found."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_info_reports_what_is_built_and_found(tmp_path: Path) -> None:
    """python -m commsched.info --json lists every part, and its built flags match what imports."""
    done = subprocess.run(
        [sys.executable, "-m", "commsched.info", "--json"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    parts = {part["name"]: part for part in json.loads(done.stdout)}
    for name in ["commsched._core", "commsched._mpi", "commsched._nccl", "commsched._gloo", "TensorFlow ops"]:
        assert parts[name]["kind"] == "built", parts[name]
    for name in ["MPI library", "NCCL", "CUDA runtime", "PyTorch", "TensorFlow"]:
        assert parts[name]["kind"] == "found", parts[name]
    for module in ["commsched._core", "commsched._mpi", "commsched._nccl"]:
        assert parts[module]["ok"] == (importlib.util.find_spec(module) is not None), parts[module]
    for part in parts.values():
        assert part["ok"] or part["needs"], f"{part['name']} is missing but says nothing of what it needs"


def test_info_names_an_extension_built_for_another_torch() -> None:
    """An extension built for one torch, with another installed, is reported missing with the reason."""
    pytest.importorskip("torch")
    from commsched import info

    if importlib.util.find_spec("commsched._gloo") is None:
        pytest.skip("commsched._gloo is not built here")
    parts = {part.name: part for part in info.built_parts({}, torch_version="0.0.0-other")}
    gloo = parts["commsched._gloo"]
    assert not gloo.ok
    assert "torch 0.0.0-other is installed" in gloo.detail
    assert "reinstall commsched" in gloo.needs


def test_source_tree_without_core_says_what_to_do(tmp_path: Path) -> None:
    """Importing commsched from a checkout's root with no built core fails at once naming the fix."""
    shutil.copytree(
        ROOT / "commsched",
        tmp_path / "commsched",
        ignore=shutil.ignore_patterns("*.so", "__pycache__", "_build_report.json"),
    )
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    # -S: no site-packages, so this venv's editable finder cannot lend the copy the real _core, as
    # after a non-editable install nothing lends the source folder one.
    for command in (["-c", "import commsched"], ["-m", "commsched.run", "--help"]):
        done = subprocess.run(
            [sys.executable, "-S", *command],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode != 0, done.stdout
        assert "source folder" in done.stderr, done.stderr
        assert "pip install -e ." in done.stderr, done.stderr
        assert "circular import" not in done.stderr, done.stderr


def test_missing_tensorflow_is_named(tmp_path: Path) -> None:
    """commsched.tensorflow without TensorFlow says TensorFlow is needed and how to install it."""
    hide = "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None; import commsched.tensorflow"
    done = subprocess.run(
        [sys.executable, "-c", hide],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "needs TensorFlow" in done.stderr, done.stderr
    assert "pip install tensorflow-cpu" in done.stderr, done.stderr
