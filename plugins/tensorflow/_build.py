"""Loads the custom TensorFlow ops: the library a wheel carries when it was built for the installed
TensorFlow and these sources, else one compiled against the installed TensorFlow, once, into a cache.

The cached library is keyed by TensorFlow's version and a hash of the sources, the compiler and
TensorFlow's flags, so a TensorFlow upgrade or an edited op source triggers a rebuild.
Several ranks may start at once: one builds under a file lock, into a temporary file
that is renamed into place, and the others find the finished library.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = (HERE / "ops" / "commsched_ops.cc", HERE / "ops" / "op_definitions.cc")
HEADERS = (HERE / "ops" / "core_link.h",)
LIBRARY_NAME = "libcommsched_tf_ops.so"
CACHE_VARIABLE = "COMMSCHED_TF_OPS_DIR"
# What setup.py builds with COMMSCHED_WITH_TF_OPS=1 (scripts/build_wheels.sh sets it): the library
# beside this file, and what it was built for, so a wheel needs no compiler on the user's machine.
PREBUILT_GLOB = "_tf_ops.*.so"
PREBUILT_INFO = "_tf_ops.json"


class BuildError(RuntimeError):
    """The TensorFlow ops could not be compiled; the message says why and what to do."""


def header_dir() -> Path:
    """The include directory holding core/c_api.h (shipped with the package or in the source tree)."""
    import commsched

    candidates = [Path(commsched.__file__).resolve().parent / "include"]
    for candidate in candidates:
        if (candidate / "core" / "c_api.h").is_file():
            return candidate
    raise BuildError(
        "commsched's C ABI header core/c_api.h was not found in "
        + " or ".join(str(c) for c in candidates)
        + "; install commsched from its source tree (pip install -e .)"
    )


def compiler() -> str:
    """The C++ compiler to use: $CXX, else c++, g++ or clang++ on PATH."""
    explicit = os.environ.get("CXX")
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise BuildError(f"CXX={explicit!r} is not an executable on PATH; point CXX at a C++17 compiler")
        return found
    for name in ("c++", "g++", "clang++"):
        found = shutil.which(name)
        if found is not None:
            return found
    raise BuildError(
        "commsched.tensorflow compiles its TensorFlow ops on first use and needs a C++17 compiler, "
        "but none of c++, g++, clang++ is on PATH; install one (apt-get install g++) or set CXX"
    )


def tf_flags() -> tuple[list[str], list[str]]:
    """TensorFlow's compile and link flags for custom ops."""
    import tensorflow as tf

    return list(tf.sysconfig.get_compile_flags()), list(tf.sysconfig.get_link_flags())


def cache_key(tf_version: str, parts: list[bytes]) -> str:
    """`<tf version>-<hash>`: a new TensorFlow, source, compiler or flag set gets a new library."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return f"{tf_version}-{digest.hexdigest()[:16]}"


def cache_root() -> Path:
    """$COMMSCHED_TF_OPS_DIR, else ~/.cache/commsched/tf-ops (XDG_CACHE_HOME honoured)."""
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "commsched" / "tf-ops"


def _command(
    cxx: str, output: Path, include: Path, compile_flags: list[str], link_flags: list[str]
) -> list[str]:
    # -w: TensorFlow's own headers emit hundreds of deprecation warnings that say nothing about ours.
    return [
        cxx,
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-O2",
        "-w",
        *(str(source) for source in SOURCES),
        f"-I{include}",
        *compile_flags,
        "-o",
        str(output),
        *link_flags,
        "-ldl",
    ]


def sources_digest(include: Path) -> str:
    """A hash of the op sources and the C ABI header in `include`: a prebuilt library must match it."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS, include / "core" / "c_api.h"):
        data = path.read_bytes()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:16]


def prebuilt(directory: Path = HERE) -> tuple[Path | None, dict[str, str]]:
    """(the op library built at install time, or None; what it was built for: tensorflow, sources)."""
    libraries = sorted(directory.glob(PREBUILT_GLOB))
    try:
        facts = json.loads((directory / PREBUILT_INFO).read_text())
    except (OSError, ValueError):
        return None, {}
    if not libraries or not isinstance(facts, dict):
        return None, {}
    return libraries[0], {str(key): str(value) for key, value in facts.items()}


def usable_prebuilt(tf_version: str, directory: Path = HERE) -> tuple[Path | None, str]:
    """(the prebuilt library if it fits this TensorFlow and these sources, else None; why it does not)."""
    library, facts = prebuilt(directory)
    if library is None:
        return None, "this installation carries no prebuilt TensorFlow ops"
    if facts.get("tensorflow") != tf_version:
        return None, (
            f"this installation's TensorFlow ops were built for TensorFlow {facts.get('tensorflow')}, "
            f"but {tf_version} is installed (pip install tensorflow-cpu=={facts.get('tensorflow')} uses them)"
        )
    if facts.get("sources") != sources_digest(header_dir()):
        return None, "the op sources changed since the prebuilt TensorFlow ops were built"
    return library, ""


def library_path() -> Path:
    """Where the library for this TensorFlow and these sources lives (built or not)."""
    import tensorflow as tf

    include = header_dir()
    compile_flags, link_flags = tf_flags()
    cxx = compiler()
    parts = [
        *(path.read_bytes() for path in (*SOURCES, *HEADERS)),
        (include / "core" / "c_api.h").read_bytes(),
        cxx.encode(),
        " ".join(compile_flags + link_flags).encode(),
    ]
    return cache_root() / cache_key(tf.__version__, parts) / LIBRARY_NAME


def build(target: Path) -> Path:
    """Compiles the ops into `target` unless it exists; safe when several processes race."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the losers wait here, then find the winner's library
        if target.is_file():
            return target
        compile_flags, link_flags = tf_flags()
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".build-", suffix=".so")
        os.close(handle)
        command = _command(compiler(), Path(temporary), header_dir(), compile_flags, link_flags)
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                raise BuildError(
                    f"compiling commsched's TensorFlow ops failed (exit {result.returncode}):\n"
                    + " ".join(command)
                    + "\n"
                    + result.stderr[-4000:]
                )
            os.replace(temporary, target)  # atomic: a reader sees no library or a whole one
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
    return target


@functools.lru_cache(maxsize=1)
def load() -> Any:
    """The loaded op module (tf.load_op_library): the prebuilt library when it fits, else the cached one,
    building it first if needed."""
    import tensorflow as tf

    library, unusable = usable_prebuilt(tf.__version__)
    if library is not None:
        return tf.load_op_library(str(library))
    try:
        target = library_path()
    except BuildError as error:
        raise BuildError(f"{unusable}; {error}") from error
    return tf.load_op_library(str(build(target)))
