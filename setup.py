"""Builds commsched's C++ core (`commsched._core`) and, where MPI is found, its MPI transport (`commsched._mpi`);
where PyTorch is importable, its native Gloo transport (`commsched._gloo`); with COMMSCHED_WITH_TF_OPS=1
and TensorFlow importable, the TensorFlow ops (`commsched.tensorflow._tf_ops`)."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import Extension, setup
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError

ROOT = Path(__file__).resolve().parent
CORE_SOURCES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "core").glob("*.cc"))
COMPILE_ARGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]

# Why each part was not built ("" when it was); written beside the package as _build_report.json
# for commsched-info, since pip shows a successful build's messages only with -v.
BUILD_REPORT: dict[str, str] = {}


def skip(name: str, reason: str) -> None:
    """Records and prints that an optional part is built without, and why."""
    BUILD_REPORT[name] = reason
    message = f"commsched: WARNING: not building {name}: {reason}"
    print(message, file=sys.stderr)
    if not sys.stderr.isatty():
        # pip keeps a successful build's output to itself unless -v; the terminal still hears it.
        try:
            with open("/dev/tty", "w") as terminal:
                print(message, file=terminal)
        except OSError:
            pass  # no terminal (CI): the message stays in the log and in _build_report.json


def build_jobs() -> int:
    """How many compilers run at once: COMMSCHED_BUILD_JOBS, else one per CPU."""
    value = os.environ.get("COMMSCHED_BUILD_JOBS", "").strip()
    if not value:
        return os.cpu_count() or 1
    if not value.isdigit() or int(value) < 1:
        raise SystemExit(
            f"COMMSCHED_BUILD_JOBS={value!r}: give how many compilers may run at once, a whole number "
            "of 1 or more (unset: one per CPU)"
        )
    return int(value)


BUILD_JOBS = build_jobs()


def one_unit(name: str, sources: list[str]) -> str:
    """A file under build/ that #includes `sources`, compiled in their place: they then parse the heavy
    headers they share (pybind11's, torch's) once, which is most of each one's compile time (the
    bindings: 22 s together against 63 s apart). Such sources keep their file-local names distinct."""
    unit = ROOT / "build" / "units" / f"{name}.cc"
    text = "".join(f'#include "{ROOT / source}"\n' for source in sources)
    if not unit.is_file() or unit.read_text() != text:
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(text)
    return str(unit.relative_to(ROOT))


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
        # The bindings' unit first: the longest file of the module, it should not start last.
        [
            one_unit(
                "core_bindings",
                [
                    "csrc/transport/python/python_transport.cc",
                    "csrc/bindings/core_module.cc",
                    "csrc/bindings/c_api.cc",
                    "csrc/bindings/run_buffer.cc",
                    "csrc/bindings/timeline_bindings.cc",
                    "csrc/bindings/host_copy_bindings.cc",
                    "csrc/bindings/sim_bindings.cc",
                ],
            )
        ]
        + CORE_SOURCES
        + [
            "csrc/transport/loopback/loopback_transport.cc",
            "csrc/transport/control/control_wire.cc",
            "csrc/transport/control/host_identity.cc",
            "csrc/transport/control/tcp_control_channel.cc",
        ]
        + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "sim").glob("*.cc")),
        include_dirs=["csrc", "commsched/include"],
        cxx_std=17,
        extra_compile_args=COMPILE_ARGS,
    )
]

mpi = None if os.environ.get("COMMSCHED_WITHOUT_MPI") else find_mpi()
mpi_missing = (
    "COMMSCHED_WITHOUT_MPI is set"
    if os.environ.get("COMMSCHED_WITHOUT_MPI")
    else "no MPI found (mpi.h and libmpi in the environment, /usr, /usr/local, COMMSCHED_MPI_DIR or "
    "`mpicc -show`): install MPI first (e.g. `pip install mpich`), then commsched"
)
if mpi:
    includes, libdirs, libs = mpi
    extensions.append(
        Pybind11Extension(
            "commsched._mpi",
            [
                "csrc/transport/mpi/mpi_transport.cc",
                "csrc/transport/mpi/mpi_algorithms.cc",
                "csrc/transport/mpi/cuda_aware_mpi.cc",
                "csrc/transport/mpi/mpi_module.cc",
                "csrc/transport/nccl/nccl_loader.cc",
                "csrc/transport/nccl/cuda_objects.cc",
                "csrc/core/elementwise.cc",
                "csrc/core/types.cc",
            ],
            include_dirs=["csrc", *includes],
            library_dirs=libdirs,
            # The environment's lib as seen from site-packages/commsched, where pip's mpich puts libmpi:
            # a wheel built elsewhere finds the user's MPI there.
            runtime_library_dirs=[*libdirs, "$ORIGIN/../../.."],
            libraries=[*libs, "dl"],
            cxx_std=17,
            extra_compile_args=COMPILE_ARGS,
        )
    )
    BUILD_REPORT["commsched._mpi"] = ""
else:
    skip("commsched._mpi", mpi_missing)

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
    one_unit(
        "gloo",
        [
            "csrc/transport/gloo/gloo_transport.cc",
            "csrc/transport/gloo/gloo_ring.cc",
            "csrc/transport/gloo/peer_probe.cc",
            "csrc/transport/gloo/gloo_module.cc",
        ],
    ),
    "csrc/core/elementwise.cc",
    "csrc/core/types.cc",
]
# One unit: both files parse torch's pybind casters, most of each one's compile time.
TORCH_HOOKS_SOURCES = [
    one_unit("torch_hooks", ["csrc/torch/grad_counter.cc", "csrc/torch/capture_copies.cc"]),
    "csrc/core/host_copy.cc",
]
# What commsched does without each optional extension, for the message when one is not built.
OPTIONAL_EXTENSIONS = {
    "commsched._gloo": "COMMSCHED_TRANSPORT=gloo then uses the Python transport",
    "commsched._torch_hooks": "commsched.torch then counts gradients and tests checkpoint copies in Python",
    "commsched.tensorflow._tf_ops": "commsched.tensorflow then compiles its ops on first use (needs a C++ compiler)",
}
TF_OPS = "commsched.tensorflow._tf_ops"


# torch's (and TensorFlow's) build facts, asked of the interpreter the package is installed for.
# Under pip's build isolation this process sees only the build requirements, not the user's torch,
# so when torch is not importable here the same interpreter is run without the isolation variables
# (PYTHONPATH, PYTHONNOUSERSITE, PIP_*): it sees the environment's own site-packages. Nothing
# installs torch.
TORCH_PROBE = """
import json, torch
from torch.utils import cpp_extension
print(json.dumps({
    "version": torch.__version__,
    "includes": cpp_extension.include_paths(),
    "libdirs": cpp_extension.library_paths(),
    "abi": int(torch._C._GLIBCXX_USE_CXX11_ABI),
}))
"""


TF_PROBE = """
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
print(json.dumps({
    "version": tf.__version__,
    "compile": tf.sysconfig.get_compile_flags(),
    "link": tf.sysconfig.get_link_flags(),
}))
"""


def probe_framework(
    code: str = TORCH_PROBE, module: str = "torch", what: str = "PyTorch"
) -> tuple[dict | None, str]:
    """What `code` prints of `module` (by default torch's version, include and library paths and
    libstdc++ ABI), or None and why not."""
    if importlib.util.find_spec(module) is None:
        env = {
            key: value
            for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME") and not key.startswith("PIP_")
        }
        where = f"{sys.executable} outside the build environment"
    else:
        env = dict(os.environ)
        where = sys.executable
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"asking {where} for {module} failed ({error})"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        if f"No module named '{module}'" in last:
            return (
                None,
                f"{what} is not installed for {sys.executable} (install {what} first, then commsched)",
            )
        return None, f"importing {module} in {where} failed: {last}"
    return json.loads(done.stdout.strip().splitlines()[-1]), ""


TORCH: dict | None = None
TORCH_MISSING = ""
if os.environ.get("COMMSCHED_WITHOUT_TORCH"):
    TORCH_MISSING = "COMMSCHED_WITHOUT_TORCH is set"
else:
    TORCH, TORCH_MISSING = probe_framework()


def torch_extension(name: str, sources: list[str], needs_c10d: bool) -> Extension | None:
    """An extension built against PyTorch's headers and libraries, or None (with the reason on
    stderr) when PyTorch's C++ side is not usable here."""
    effect = OPTIONAL_EXTENSIONS[name]
    if TORCH is None:
        skip(name, f"{TORCH_MISSING}; {effect}")
        return None
    includes = TORCH["includes"]
    if needs_c10d and not any(
        (Path(d) / "torch" / "csrc" / "distributed" / "c10d" / "Backend.hpp").exists() for d in includes
    ):
        skip(name, f"PyTorch {TORCH['version']} has no c10d headers; {effect}")
        return None
    # The core and these modules pass std::string and std::vector across their interfaces, and the
    # core is built with the compiler's default (new) libstdc++ ABI: torch must match it.
    abi = TORCH["abi"]
    if abi != 1:
        skip(name, f"PyTorch {TORCH['version']} was built with the pre-C++11 libstdc++ ABI; {effect}")
        return None
    libdirs = TORCH["libdirs"]
    BUILD_REPORT[name] = ""
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
            ("COMMSCHED_BUILT_FOR_TORCH", f'"{TORCH["version"]}"'),
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


# What tf_ops_extension found: the TensorFlow the ops are built against.
TENSORFLOW: dict = {}


def tf_ops_extension() -> Extension | None:
    """The TensorFlow ops built against the TensorFlow installed here, for a wheel whose users may have
    no compiler; None unless COMMSCHED_WITH_TF_OPS=1 (a source install compiles them on first use)."""
    if not os.environ.get("COMMSCHED_WITH_TF_OPS"):
        return None
    found, missing = probe_framework(TF_PROBE, "tensorflow", "TensorFlow")
    if found is None:
        skip(TF_OPS, f"{missing}; {OPTIONAL_EXTENSIONS[TF_OPS]}")
        return None
    TENSORFLOW.update(found)
    ops = ROOT / "plugins" / "tensorflow" / "ops"
    BUILD_REPORT[TF_OPS] = ""
    return Extension(
        TF_OPS,
        [str((ops / name).relative_to(ROOT)) for name in ("commsched_ops.cc", "op_definitions.cc")],
        include_dirs=["commsched/include", *(flag[2:] for flag in found["compile"] if flag.startswith("-I"))],
        libraries=["dl"],
        # -w: TensorFlow's headers emit hundreds of deprecation warnings that say nothing about the ops.
        extra_compile_args=[
            "-std=c++17",
            "-O2",
            "-w",
            *(flag for flag in found["compile"] if flag.startswith("-D")),
        ],
        # libtensorflow_framework is loaded by `import tensorflow` before the ops: no run path needed.
        extra_link_args=list(found["link"]),
        language="c++",
    )


def tf_ops_facts() -> dict[str, str]:
    """What the TensorFlow ops are built for, read by commsched.tensorflow._build before loading them."""
    spec = importlib.util.spec_from_file_location(
        "tf_ops_build", ROOT / "plugins" / "tensorflow" / "_build.py"
    )
    assert spec is not None and spec.loader is not None
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    return {
        "tensorflow": TENSORFLOW["version"],
        "sources": loader.sources_digest(ROOT / "commsched" / "include"),
    }


class build_optional_ext(build_ext):
    """Builds every extension, but reports and skips an optional one that fails instead of failing the install.
    Up to BUILD_JOBS files compile at once, from any extension."""

    def finalize_options(self) -> None:
        """Builds the extensions side by side unless --parallel says otherwise."""
        super().finalize_options()
        if self.parallel is None and BUILD_JOBS > 1:
            self.parallel = BUILD_JOBS

    def build_extensions(self) -> None:
        """Builds the slowest extensions first, then drops the optional ones that failed from the list."""
        # The files built against torch's headers take 15-35 s each, the others mostly under 10 s:
        # started first, they overlap the core's many small files instead of ending the build alone.
        self.extensions.sort(key=lambda ext: ext.name not in OPTIONAL_EXTENSIONS)
        self.failed: set[str] = set()
        # Each extension's files compile on ParallelCompile's threads; one limit for all extensions
        # keeps a many-CPU machine from running (extensions x CPUs) compilers at once.
        slots = threading.BoundedSemaphore(BUILD_JOBS)
        compile_file = self.compiler._compile

        def limited(*args: object, **kwargs: object) -> None:
            with slots:
                compile_file(*args, **kwargs)

        self.compiler._compile = limited
        # Each extension's objects in a folder of its own: built side by side, two of them would
        # write csrc/core/elementwise.o (compiled with different flags) at the same path.
        compile_sources = self.compiler.compile
        self.building = threading.local()

        def compile_apart(sources: list[str], output_dir: str | None = None, **kwargs: object) -> list[str]:
            folder = os.path.join(output_dir or self.build_temp, self.building.name)
            return compile_sources(sources, output_dir=folder, **kwargs)

        self.compiler.compile = compile_apart
        super().build_extensions()
        # Out of the list, so neither --inplace's copy nor the install looks for their output (nor
        # a stale one from an earlier build).
        self.extensions = [ext for ext in self.extensions if ext.name not in self.failed]

    def run(self) -> None:
        """Builds, then writes _build_report.json beside the built package."""
        super().run()
        built = {ext.name for ext in self.extensions}
        for name in OPTIONAL_EXTENSIONS:
            if name not in built:
                # A module from an earlier build of another torch must not ship with this one.
                stale = Path(self.get_ext_fullpath(name))
                if stale.exists() and not self.inplace:
                    stale.unlink()
        report = Path(self.get_ext_fullpath("commsched._core")).parent / "_build_report.json"
        report.parent.mkdir(parents=True, exist_ok=True)
        report.write_text(json.dumps(BUILD_REPORT, indent=1, sort_keys=True) + "\n")
        facts = Path(self.get_ext_fullpath(TF_OPS)).parent / "_tf_ops.json"
        if TF_OPS in built:
            facts.write_text(json.dumps(tf_ops_facts(), indent=1, sort_keys=True) + "\n")
        elif facts.exists() and not self.inplace:
            facts.unlink()

    def build_extension(self, ext: Extension) -> None:
        self.building.name = ext.name
        if ext.name not in OPTIONAL_EXTENSIONS:
            try:
                return super().build_extension(ext)
            except (CCompilerError, CompileError, ExecError, LinkError, OSError) as error:
                raise CompileError(
                    f"commsched: building {ext.name} failed. commsched's C++ core needs a C++17 compiler "
                    "(g++ 9+ or clang++ 10+; CXX chooses it): install one, e.g. `apt-get install g++`, or "
                    f"install a prebuilt commsched wheel. The failure: {error}"
                ) from error
        try:
            super().build_extension(ext)
        except (CCompilerError, CompileError, ExecError, LinkError, OSError) as error:
            skip(ext.name, f"its build failed ({error}); {OPTIONAL_EXTENSIONS[ext.name]}")
            self.failed.add(ext.name)


for optional in (
    torch_extension("commsched._gloo", GLOO_SOURCES, needs_c10d=True),
    torch_extension("commsched._torch_hooks", TORCH_HOOKS_SOURCES, needs_c10d=False),
    tf_ops_extension(),
):
    if optional is not None:
        extensions.append(optional)

# Always recompiles, as setuptools does: an object left by an earlier build may be stale.
ParallelCompile(default=BUILD_JOBS, needs_recompile=lambda obj, src: True).install()
setup(ext_modules=extensions, cmdclass={"build_ext": build_optional_ext})
