"""Builds commsched's C++ core (`commsched._core`) and, where MPI is found, its MPI transport (`commsched._mpi`)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent
CORE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "core").glob("*.cc"))
COMPILE_ARGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def find_mpi() -> tuple[list[str], list[str], list[str]] | None:
    """Returns (include dirs, library dirs, libraries) of the MPI in the active environment or the system."""
    explicit = os.environ.get("COMMSCHED_MPI_DIR")
    prefixes = [Path(explicit)] if explicit else [Path(sys.prefix), Path("/usr"), Path("/usr/local")]
    for prefix in prefixes:
        header = prefix / "include" / "mpi.h"
        for libdir in (prefix / "lib", prefix / "lib64", prefix / "lib" / "x86_64-linux-gnu"):
            if header.exists() and any(libdir.glob("libmpi.so*")):
                return [str(header.parent)], [str(libdir)], ["mpi"]
    mpicc = shutil.which("mpicc")
    if mpicc:
        try:
            flags = shlex.split(subprocess.check_output([mpicc, "-show"], text=True))
        except (OSError, subprocess.CalledProcessError):
            return None
        includes = [f[2:] for f in flags if f.startswith("-I")]
        libdirs = [f[2:] for f in flags if f.startswith("-L")]
        libs = [f[2:] for f in flags if f.startswith("-l")]
        if libs:
            return includes, libdirs, libs
    return None


extensions = [
    Pybind11Extension(
        "commsched._core",
        CORE_SOURCES
        + [
            "csrc/transport/loopback/loopback_transport.cc",
            "csrc/transport/python/python_transport.cc",
            "csrc/bindings/core_module.cc",
            "csrc/bindings/c_api.cc",
            "csrc/bindings/run_buffer.cc",
            "csrc/bindings/timeline_bindings.cc",
        ]
        + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "sim").glob("*.cc"))
        + ["csrc/bindings/sim_bindings.cc"],
        include_dirs=["csrc", "commsched/include"],
        cxx_std=17,
        extra_compile_args=COMPILE_ARGS,
    )
]

mpi = None if os.environ.get("COMMSCHED_WITHOUT_MPI") else find_mpi()
if mpi:
    includes, libdirs, libs = mpi
    extensions.append(
        Pybind11Extension(
            "commsched._mpi",
            [
                "csrc/transport/mpi/mpi_transport.cc",
                "csrc/transport/mpi/cuda_aware_mpi.cc",
                "csrc/transport/mpi/mpi_module.cc",
                "csrc/transport/nccl/nccl_loader.cc",
                "csrc/transport/nccl/cuda_objects.cc",
                "csrc/core/elementwise.cc",
                "csrc/core/types.cc",
            ],
            include_dirs=["csrc", *includes],
            library_dirs=libdirs,
            runtime_library_dirs=libdirs,
            libraries=[*libs, "dl"],
            cxx_std=17,
            extra_compile_args=COMPILE_ARGS,
        )
    )
else:
    print("commsched: no MPI found (mpi.h and libmpi); building without the MPI transport", file=sys.stderr)

# The NCCL transport links neither NCCL nor CUDA (it loads them at run time), so it is always built.
extensions.append(
    Pybind11Extension(
        "commsched._nccl",
        sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "transport" / "nccl").glob("*.cc"))
        + ["csrc/core/elementwise.cc", "csrc/core/types.cc"],
        include_dirs=["csrc", "commsched/include"],
        libraries=["dl"],
        cxx_std=17,
        extra_compile_args=COMPILE_ARGS,
    )
)

setup(ext_modules=extensions, cmdclass={"build_ext": build_ext})
