"""Builds commsched's C++ core (`commsched._core`) and, where MPI is found, its MPI transport (`commsched._mpi`);
where PyTorch is importable, its native Gloo transport (`commsched._gloo`)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import Extension, setup
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError

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
            "csrc/transport/control/control_wire.cc",
            "csrc/transport/control/host_identity.cc",
            "csrc/transport/control/tcp_control_channel.cc",
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


# --- Parts built against PyTorch's C++ side: native Gloo (commsched._gloo), gradient hooks ---------
# Built when torch is importable here; without it (or when a build fails) commsched uses its Python
# Gloo transport and Python gradient hooks, so these extensions never fail an install.
GLOO_SOURCES = [
    "csrc/transport/gloo/gloo_transport.cc",
    "csrc/transport/gloo/peer_probe.cc",
    "csrc/transport/gloo/gloo_module.cc",
    "csrc/core/elementwise.cc",
    "csrc/core/types.cc",
]
TORCH_HOOKS_SOURCES = ["csrc/torch/grad_counter.cc"]
# What commsched does without each optional extension, for the message when one is not built.
OPTIONAL_EXTENSIONS = {
    "commsched._gloo": "COMMSCHED_TRANSPORT=gloo then uses the Python transport",
    "commsched._torch_hooks": "commsched.torch then counts gradients with Python hooks",
}


def torch_extension(name: str, sources: list[str], needs_c10d: bool) -> Extension | None:
    """An extension built against PyTorch's headers and libraries, or None (with the reason on
    stderr) when PyTorch's C++ side is not usable here."""
    part = f"{name} ({OPTIONAL_EXTENSIONS[name]})"
    if os.environ.get("COMMSCHED_WITHOUT_TORCH"):
        print(f"commsched: COMMSCHED_WITHOUT_TORCH is set; building without {part}", file=sys.stderr)
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print(f"commsched: PyTorch is not importable; building without {part}", file=sys.stderr)
        return None
    includes = cpp_extension.include_paths()
    if needs_c10d and not any(
        (Path(d) / "torch" / "csrc" / "distributed" / "c10d" / "Backend.hpp").exists() for d in includes
    ):
        print(f"commsched: this PyTorch has no c10d headers; building without {part}", file=sys.stderr)
        return None
    # The core and these modules pass std::string and std::vector across their interfaces, and the
    # core is built with the compiler's default (new) libstdc++ ABI: torch must match it.
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    if abi != 1:
        print(
            f"commsched: PyTorch was built with the pre-C++11 libstdc++ ABI; building without {part}",
            file=sys.stderr,
        )
        return None
    libdirs = cpp_extension.library_paths()
    return Extension(
        name,
        sources,
        # torch's include directories come first: its bundled pybind11 is the one whose casters
        # know torch's types.
        include_dirs=[*includes, "csrc"],
        library_dirs=libdirs,
        runtime_library_dirs=[*libdirs, "$ORIGIN/../torch/lib"],
        libraries=["c10", "torch", "torch_cpu", "torch_python"],
        define_macros=[
            ("_GLIBCXX_USE_CXX11_ABI", str(abi)),
            ("TORCH_API_INCLUDE_EXTENSION_H", None),
            # torch's C++ classes change between releases: each module refuses to serve another torch.
            ("COMMSCHED_BUILT_FOR_TORCH", f'"{torch.__version__}"'),
        ],
        # Spelled out: the Pybind11Extensions above extend the COMPILE_ARGS list with their own -std.
        extra_compile_args=[
            "-std=c++20",
            "-fvisibility=hidden",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Wno-unused-parameter",
        ],
        language="c++",
    )


class build_optional_ext(build_ext):
    """Builds every extension, but reports and skips an optional one that fails instead of failing the install."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name not in OPTIONAL_EXTENSIONS:
            return super().build_extension(ext)
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, LinkError, OSError) as error:
            print(
                f"commsched: building {ext.name} failed ({error}); continuing without it "
                f"({OPTIONAL_EXTENSIONS[ext.name]})",
                file=sys.stderr,
            )
            # Out of the list, so neither --inplace's copy nor the install looks for its output
            # (nor a stale one from an earlier build).
            self.extensions = [other for other in self.extensions if other is not ext]


for optional in (
    torch_extension("commsched._gloo", GLOO_SOURCES, needs_c10d=True),
    torch_extension("commsched._torch_hooks", TORCH_HOOKS_SOURCES, needs_c10d=False),
):
    if optional is not None:
        extensions.append(optional)

setup(ext_modules=extensions, cmdclass={"build_ext": build_optional_ext})
