"""Horovod's small utilities that scripts and tests import from horovod.common.util and its runner.

``env`` sets environment variables for a block, ``is_version_greater_equal_than`` compares
version strings, and ``get_env_rank_and_size`` reads a launcher's rank and size variables.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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
