"""What this commsched installation holds: the parts that were built, what was found at run time,
and what each missing part needs. ``commsched-info`` or ``python -m commsched.info`` (``--json``)."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import commsched
from commsched import torch_release

PACKAGE_DIR = Path(commsched.__file__).resolve().parent
REINSTALL = "then reinstall commsched (pip install --force-reinstall --no-deps '.[torch]' from its checkout)"


@dataclasses.dataclass
class Part:
    """One row: a part of commsched or a library it uses, whether it is here, and what it needs."""

    kind: str  # "built" (made at install) or "found" (looked for at run time)
    name: str
    ok: bool
    detail: str
    needs: str = ""


def build_report() -> dict[str, str]:
    """Why each optional part was not built, as setup.py recorded it ("" when it was built)."""
    try:
        return dict(json.loads((PACKAGE_DIR / "_build_report.json").read_text()))
    except (OSError, ValueError):
        return {}


def distribution_version(*names: str) -> str:
    """The installed version of the first of `names` that is installed, else ""."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return ""


def _import(module: str) -> tuple[Any, str]:
    """(the module, "") or (None, why it does not import)."""
    if importlib.util.find_spec(module) is None:
        return None, "not built"
    try:
        return importlib.import_module(module), ""
    except ImportError as error:
        return None, f"built but does not load: {error}"


def _loadable(candidates: list[str]) -> str:
    """The first shared library of `candidates` that loads, else ""."""
    for candidate in candidates:
        if "/" in candidate and not os.path.exists(candidate):
            continue
        try:
            ctypes.CDLL(candidate)
        except OSError:
            continue
        return candidate
    return ""


def built_parts(report: dict[str, str], torch_version: str) -> list[Part]:
    """The extension modules made at install and the TensorFlow ops, each built or not and why."""
    parts: list[Part] = []
    for module, what in [
        ("commsched._core", "the scheduler core, loopback and the simulator"),
        ("commsched._nccl", "the NCCL transport (loads NCCL and CUDA at run time)"),
    ]:
        loaded, why = _import(module)
        parts.append(Part("built", module, loaded is not None, why or what, "" if loaded else REINSTALL))
    loaded, why = _import("commsched._mpi")
    needs = (
        ""
        if loaded
        else f"{report.get('commsched._mpi') or 'MPI (mpi.h and libmpi) at install'}; "
        f"install MPI (pip install mpich mpi4py), {REINSTALL}"
    )
    parts.append(Part("built", "commsched._mpi", loaded is not None, why or "the MPI transport", needs))
    for module, what in [
        ("commsched._gloo", "the native Gloo transport (else the Python one over torch.distributed)"),
        ("commsched._torch_hooks", "gradients counted and checkpoint copies tested in C++ (else in Python)"),
    ]:
        loaded, why = _import(module) if torch_version else (None, "PyTorch is not installed")
        built_for = getattr(loaded, "built_for_torch", "")
        if loaded is not None and not torch_release.fits(built_for, torch_version):
            why, loaded = f"built for torch {built_for}, but torch {torch_version} is installed", None
        needs = ""
        if loaded is None:
            reason = report.get(module) or why
            needs = f"{reason}; needs PyTorch installed before commsched, {REINSTALL}"
        parts.append(
            Part("built", module, loaded is not None, why or f"{what}, for torch {built_for}", needs)
        )
    parts.append(tensorflow_ops())
    return parts


def tensorflow_ops() -> Part:
    """Whether commsched's TensorFlow ops are compiled for the installed TensorFlow."""
    name = "TensorFlow ops"
    if not distribution_version("tensorflow", "tensorflow-cpu"):
        return Part("built", name, False, "TensorFlow is not installed", "pip install tensorflow-cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter would hide the table
    from commsched.tensorflow import _build

    unusable = ""
    try:
        import tensorflow as tf

        prebuilt, unusable = _build.usable_prebuilt(tf.__version__)
        if prebuilt is not None:
            return Part("built", name, True, f"built at install for TensorFlow {tf.__version__}: {prebuilt}")
        library = _build.library_path()
    except _build.BuildError as error:
        return Part("built", name, False, "not compiled yet", "; ".join(filter(None, [unusable, str(error)])))
    except Exception as error:  # noqa: BLE001 - any TensorFlow import failure is reported as such
        return Part("built", name, False, f"TensorFlow does not import: {error}", "a working TensorFlow")
    if library.is_file():
        return Part("built", name, True, f"compiled in {library.parent}")
    return Part(
        "built", name, True, f"compiled on first use with {_build.compiler()} into {_build.cache_root()}"
    )


def found_parts(torch_version: str, tf_version: str) -> list[Part]:
    """What commsched finds at run time: MPI, NCCL, CUDA, PyTorch, TensorFlow."""
    parts: list[Part] = []
    mpi_module, _ = _import("commsched._mpi")
    if mpi_module is not None:
        library = mpi_module.library_version().splitlines()[0].strip()
        parts.append(Part("found", "MPI library", True, library))
    else:
        parts.append(Part("found", "MPI library", False, "commsched._mpi is not built", "see commsched._mpi"))
    # The environment's own bin first: pip's mpich puts mpiexec there, on PATH only when activated.
    beside = Path(sys.executable).parent / "mpiexec"
    launcher = str(beside) if beside.is_file() else shutil.which("mpiexec")
    mpi4py = distribution_version("mpi4py")
    parts.append(
        Part(
            "found",
            "mpiexec, mpi4py",
            bool(launcher and mpi4py),
            f"mpiexec: {launcher or 'not on PATH'}; mpi4py: {mpi4py or 'not installed'}",
            "" if launcher and mpi4py else "pip install mpich mpi4py (to launch with mpiexec)",
        )
    )
    from commsched.transports import nccl

    nccl_paths, cudart_paths = nccl.library_candidates()
    for name, candidates, package in [
        ("NCCL", nccl_paths, "nvidia-nccl-cu12"),
        ("CUDA runtime", cudart_paths, "nvidia-cuda-runtime-cu12"),
    ]:
        found = _loadable(candidates)
        needs = (
            "" if found else f"for GPU tensors: pip install {package}, or COMMSCHED_{name.split()[0]}_LIBRARY"
        )
        parts.append(Part("found", name, bool(found), found or "not found", needs))
    parts.append(
        Part(
            "found",
            "PyTorch",
            bool(torch_version),
            torch_version or "not installed",
            "" if torch_version else "pip install torch (for commsched.torch and Gloo)",
        )
    )
    parts.append(
        Part(
            "found",
            "TensorFlow",
            bool(tf_version),
            tf_version or "not installed",
            "" if tf_version else "pip install tensorflow-cpu (for commsched.tensorflow)",
        )
    )
    return parts


def report() -> list[Part]:
    """Every part, built and found."""
    torch_version = ""
    if importlib.util.find_spec("torch") is not None:
        import torch  # loaded first: commsched._gloo and _torch_hooks link against its libraries

        torch_version = str(torch.__version__)
    tf_version = distribution_version("tensorflow", "tensorflow-cpu")
    return built_parts(build_report(), torch_version) + found_parts(torch_version, tf_version)


def main(argv: list[str] | None = None) -> int:
    """Prints the report; exit status 0 (a missing optional part is not an error)."""
    parser = argparse.ArgumentParser(
        prog="commsched-info",
        description="What this commsched installation built, what it finds at run time, "
        "and what each missing part needs.",
    )
    parser.add_argument("--json", action="store_true", help="print the parts as a JSON list")
    args = parser.parse_args(argv)
    parts = report()
    if args.json:
        print(json.dumps([dataclasses.asdict(part) for part in parts], indent=1))
        return 0
    print(f"commsched {commsched.__version__} in {PACKAGE_DIR} (Python {sys.version.split()[0]})")
    width = max(len(part.name) for part in parts)
    for kind, title in [("built", "Built at install"), ("found", "Found at run time")]:
        print(f"\n{title}:")
        for part in (p for p in parts if p.kind == kind):
            mark = "yes" if part.ok else "no "
            print(f"  {part.name:<{width}}  {mark}  {part.detail}")
            if part.needs:
                print(f"  {'':<{width}}       needs: {part.needs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
