"""What a new installation shows: commsched-info's report, the source-tree trap's message, the
message for a missing TensorFlow; what an sdist carries and when a wheel's TensorFlow ops are used."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    """The environment without PYTHONPATH, so only the installed (editable) commsched is found."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _python(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """This Python run with `args` in `cwd`, under _env(), its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_info_reports_what_is_built_and_found(tmp_path: Path) -> None:
    """python -m commsched.info --json lists every part, and its built flags match what imports."""
    done = _python(["-m", "commsched.info", "--json"], tmp_path, timeout=120)
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


def test_native_parts_fit_every_build_of_their_torch_release() -> None:
    """A part built against one build of a torch release loads into another build of it, never into
    another release (nor with no build recorded)."""
    from commsched.torch_release import fits

    assert fits("2.13.0+cpu", "2.13.0+cu130") and fits("2.13.0", "2.13.0+cpu")
    assert not fits("2.13.0+cpu", "2.13.1+cpu") and not fits("2.13.0+cpu", "2.12.0")
    assert not fits("", "2.13.0")


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
        done = _python(["-S", *command], tmp_path)
        assert done.returncode != 0, done.stdout
        assert "source folder" in done.stderr, done.stderr
        assert "pip install -e ." in done.stderr, done.stderr
        assert "circular import" not in done.stderr, done.stderr


def test_source_tree_uses_the_installed_copy_built_from_it(tmp_path: Path) -> None:
    """From a checkout's root after a non-editable install of that checkout, commsched runs with the
    installed modules; a source folder whose code differs from the install's fails naming the install."""
    import numpy

    source, site = tmp_path / "checkout", tmp_path / "site-packages"
    without_builds = shutil.ignore_patterns("*.so", "__pycache__", "_build_report.json")
    shutil.copytree(ROOT / "commsched", source / "commsched", ignore=without_builds)
    shutil.copy(ROOT / "setup.py", source / "setup.py")
    shutil.copytree(ROOT / "commsched", site / "commsched", ignore=without_builds)
    for built in (ROOT / "commsched").glob("_*.so"):
        (site / "commsched" / built.name).symlink_to(built)
    # -S leaves out this venv's editable finder, which would lend the source folder the real _core;
    # the copy standing for the install goes on sys.path after the current folder, then numpy's.
    path = [str(site), str(Path(numpy.__file__).resolve().parents[1])]
    script = (
        f"import sys; sys.path += {path!r}; import numpy as np, commsched, commsched.run; "
        "commsched.init(); print(commsched.allreduce(np.arange(4, dtype=np.float32), name='g')); "
        "print(commsched.__file__); print(commsched.run.__file__); commsched.shutdown()"
    )
    done = _python(["-S", "-c", script], source)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[0. 1. 2. 3.]", lines
    assert lines[1:] == [str(site / "commsched" / name) for name in ("__init__.py", "run.py")], lines
    with (source / "commsched" / "__init__.py").open("a") as init:
        init.write("# edited after the install\n")
    done = _python(["-S", "-c", script], source)
    assert done.returncode != 0, done.stdout
    assert f"the commsched installed at {site / 'commsched'} is from other sources" in done.stderr, (
        done.stderr
    )
    assert "pip install -e ." in done.stderr, done.stderr


def test_missing_tensorflow_is_named(tmp_path: Path) -> None:
    """commsched.tensorflow without TensorFlow says TensorFlow is needed and how to install it."""
    hide = "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None; import commsched.tensorflow"
    done = _python(["-c", hide], tmp_path)
    assert done.returncode != 0
    assert "needs TensorFlow" in done.stderr, done.stderr
    assert "pip install tensorflow-cpu" in done.stderr, done.stderr


@pytest.mark.parametrize("example", ["pytorch_mnist.py", "torch_train.py"])
def test_missing_scikit_learn_is_named(example: str, tmp_path: Path) -> None:
    """An example that trains on the digits data says, without scikit-learn, to install it."""
    pytest.importorskip("torch")
    path = str(ROOT / "examples" / example)
    hide = (
        "import runpy, sys; sys.modules['sklearn'] = None; "
        f"sys.argv = [{path!r}, '--epochs', '1']; runpy.run_path({path!r}, run_name='__main__')"
    )
    done = _python(["-c", hide], tmp_path)
    assert done.returncode != 0
    assert "pip install scikit-learn" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]


def _tracked(prefix: str = "") -> list[str]:
    """The checkout's tracked files (under `prefix`) that exist in the work tree."""
    done = subprocess.run(
        ["git", "ls-files", "-z", "--", prefix or "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"not a git checkout: {done.stderr.strip()}")
    return [name for name in done.stdout.split("\0") if name and (ROOT / name).is_file()]


def test_sdist_carries_every_source_and_no_build_output(tmp_path: Path) -> None:
    """An sdist of the tracked files, with stale build output lying in the tree, holds every C++
    source and header, the TensorFlow op sources and the C ABI header, and no .so, build/ or dist/."""
    source = tmp_path / "src"
    for name in _tracked():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    stale = [
        "commsched/_core.cpython-311-x86_64-linux-gnu.so",
        "build/lib.linux-x86_64-cpython-311/commsched/_gloo.cpython-311-x86_64-linux-gnu.so",
        "plugins/tensorflow/_tf_ops.cpython-311-x86_64-linux-gnu.so",
        "plugins/tensorflow/_tf_ops.json",
        "dist/commsched-0.1.0-cp311-cp311-linux_x86_64.whl",
    ]
    for name in stale:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(b"stale")
    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    # Neither torch nor MPI is asked for: an sdist builds nothing.
    env = {**_env(), "COMMSCHED_WITHOUT_TORCH": "1", "COMMSCHED_WITHOUT_MPI": "1"}
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "out")],
        cwd=source,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    archive = tmp_path / "out" / done.stdout.strip().splitlines()[-1]
    with tarfile.open(archive) as sdist:
        names = {member.split("/", 1)[1] for member in sdist.getnames() if "/" in member}
    needed = [*_tracked("csrc"), *_tracked("plugins/tensorflow/ops"), "commsched/include/core/c_api.h"]
    needed += ["setup.py", "pyproject.toml", "README.md"]
    assert any(name.endswith(".h") for name in needed) and any(name.endswith(".cc") for name in needed)
    assert sorted(set(needed) - names) == []
    unwanted = [
        name
        for name in names
        if name.endswith((".so", ".o", ".whl")) or name.startswith(("build/", "dist/")) or name in stale
    ]
    assert unwanted == []


def _load_build_module() -> object:
    """commsched.tensorflow._build loaded from its file, so TensorFlow need not be installed."""
    spec = importlib.util.spec_from_file_location(
        "tf_ops_build", ROOT / "plugins" / "tensorflow" / "_build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prebuilt_tensorflow_ops_only_for_their_tensorflow_and_sources(tmp_path: Path) -> None:
    """A wheel's TensorFlow ops are used only with the TensorFlow and op sources they were built from;
    otherwise the reason names the TensorFlow to install."""
    build: Any = _load_build_module()
    library = tmp_path / "_tf_ops.cpython-311-x86_64-linux-gnu.so"
    assert build.usable_prebuilt("2.21.0", tmp_path)[0] is None  # nothing built
    library.write_bytes(b"")
    digest = build.sources_digest(build.header_dir())
    facts = tmp_path / build.PREBUILT_INFO
    facts.write_text(json.dumps({"tensorflow": "2.21.0", "sources": digest}))
    assert build.usable_prebuilt("2.21.0", tmp_path) == (library, "")
    found, why = build.usable_prebuilt("2.22.0", tmp_path)
    assert found is None
    assert "built for TensorFlow 2.21.0, but 2.22.0 is installed" in why
    assert "pip install tensorflow-cpu==2.21.0" in why
    facts.write_text(json.dumps({"tensorflow": "2.21.0", "sources": "0" * 16}))
    found, why = build.usable_prebuilt("2.21.0", tmp_path)
    assert found is None and "sources changed" in why
