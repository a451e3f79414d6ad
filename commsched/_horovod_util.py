"""Horovod's small utilities that scripts and tests import from horovod.common.util and its runner.

``env`` sets environment variables for a block, ``is_version_greater_equal_than`` compares
version strings, ``get_env_rank_and_size`` reads a launcher's rank and size variables; the build
questions (``mpi_built``, ``gloo_built``, ``nccl_built``, ``extension_available``,
``gpu_available``, ``check_extension``) answer for commsched, and ``split_list``, ``is_iterable``,
``num_rank_is_power_2`` and ``_cache`` behave as Horovod's.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from packaging import version as _version


@contextlib.contextmanager
def env(**variables: str | None) -> Iterator[None]:
    """Sets the given environment variables (None values are left alone) and restores them on exit."""
    chosen = {name: value for name, value in variables.items() if value is not None}
    backup = {name: os.environ.get(name) for name in chosen}
    os.environ.update(chosen)
    try:
        yield
    finally:
        for name, old in backup.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """True when version string `ver` is at least `target`; both must be strings."""
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(  # noqa: TRY004 - Horovod raises ValueError here
            f"is_version_greater_equal_than takes two version strings, not {type(ver).__name__} "
            f"{ver!r} and {type(target).__name__} {target!r}"
        )
    return _version.parse(ver) >= _version.parse(target)


# Horovod's runner, Open MPI, MPICH/Hydra, then torchrun (which Horovod does not know).
_RANK_SIZE_VARIABLES = (
    ("HOROVOD_RANK", "HOROVOD_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("RANK", "WORLD_SIZE"),
)


def get_env_rank_and_size() -> tuple[int, int]:
    """This process's rank and the number of ranks from the launcher's variables; (0, 1) without any."""
    for rank_variable, size_variable in _RANK_SIZE_VARIABLES:
        rank, size = os.environ.get(rank_variable), os.environ.get(size_variable)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(
                f"cannot tell this process's rank and size: only one of {rank_variable} and "
                f"{size_variable} is set; set both (or neither)"
            )
    return 0, 1


_Result = TypeVar("_Result")
# Horovod's extension names (horovod.<name>) -> the commsched module that plays the role.
_EXTENSIONS = {"tensorflow": "commsched.tensorflow", "torch": "commsched.torch"}


def _cache(function: Callable[..., _Result]) -> Callable[..., _Result]:
    """Remembers `function`'s result per arguments: the first call computes it, later ones return it."""
    return functools.cache(function)


def mpi_built(verbose: bool = False) -> bool:
    """True when commsched has its MPI transport."""
    from commsched import _horovod

    return _horovod.mpi_built()


def gloo_built(verbose: bool = False) -> bool:
    """True when the Gloo transport can run here."""
    from commsched import _horovod

    return _horovod.gloo_built()


def nccl_built(verbose: bool = False) -> int:
    """NCCL's version code when commsched's NCCL transport is built and NCCL loads, else 0."""
    from commsched import _horovod

    return _horovod.nccl_built()


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when commsched's plug-in for framework `ext_base_name` ("tensorflow", "torch") imports here."""
    module = _EXTENSIONS.get(ext_base_name)
    if module is None:
        return False  # mxnet and other frameworks commsched has no plug-in for
    try:
        importlib.import_module(module)
    except ImportError as error:
        if verbose:
            print(f"commsched: extension {ext_base_name} is not available: {error}")
        return False
    return True


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when framework `ext_base_name` ("tensorflow", "torch") sees a GPU in this process."""
    try:
        if ext_base_name == "torch":
            import torch

            found = bool(torch.cuda.is_available())
        elif ext_base_name == "tensorflow":
            import tensorflow as tf

            found = bool(tf.config.list_physical_devices("GPU"))
        else:
            found = False
    except ImportError:
        found = False
    if verbose:
        print(f"commsched: {ext_base_name} {'sees' if found else 'does not see'} a GPU")
    return found


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: Any) -> None:
    """Raises ImportError naming the fix when commsched's plug-in `ext_name` (horovod.torch, ...) cannot load."""
    framework = ext_name.rsplit(".", 1)[-1]
    if not extension_available(framework):
        raise ImportError(
            f"{ext_name}: commsched's {framework} plug-in does not load here; install {framework} and commsched "
            f"in the same environment (commsched builds its {framework} parts when {framework} is importable)"
        )


def split_list(values: Sequence[Any], parts: int) -> list[Sequence[Any]]:
    """`values` cut into `parts` consecutive pieces whose lengths differ by at most one, longer ones first."""
    base, extra = divmod(len(values), parts)
    bounds = [index * base + min(index, extra) for index in range(parts + 1)]
    return [values[bounds[i] : bounds[i + 1]] for i in range(parts)]


def is_iterable(value: Any) -> bool:
    """True when `value` can be iterated over."""
    try:
        iter(value)
    except TypeError:
        return False
    return True


def num_rank_is_power_2(num_rank: int) -> bool:
    """True when `num_rank` is a power of two (Adasum's requirement)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0
