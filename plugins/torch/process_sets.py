"""Process sets (Horovod's ProcessSet, add_process_set, remove_process_set, global_process_set).

They are commsched's own when this build of commsched has them; the plug-in only passes a
set to the core with each collective, so the core's agreement orders every set's
collectives. Without core support, only the global set exists and adding one says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import commsched

_CORE = getattr(commsched, "ProcessSet", None) is not None


class _GlobalOnly:
    """The set of all ranks, for a commsched without process sets."""

    process_set_id = 0
    ranks: list[int] | None = None

    def size(self) -> int:
        """The number of ranks."""
        return commsched.size()

    def rank(self) -> int:
        """This process's rank."""
        return commsched.rank()

    def included(self) -> bool:
        """Every rank is in the global set."""
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


if _CORE:
    ProcessSet: Any = commsched.ProcessSet
    global_process_set: Any = commsched.global_process_set
    add_process_set: Any = commsched.add_process_set
    remove_process_set: Any = commsched.remove_process_set
else:
    ProcessSet = _GlobalOnly
    global_process_set = _GlobalOnly()

    def add_process_set(process_set: Any) -> Any:
        """Unavailable: this commsched has no process sets."""
        raise NotImplementedError(
            "process sets need a commsched whose core has them (commsched.add_process_set); "
            "this build runs every collective over all ranks"
        )

    def remove_process_set(process_set: Any) -> bool:
        """Unavailable: this commsched has no process sets."""
        return add_process_set(process_set)  # type: ignore[no-any-return]


def is_global(process_set: Any) -> bool:
    """True for the global set (or None)."""
    return process_set is None or process_set is global_process_set


def core_arguments(process_set: Any) -> dict[str, Any]:
    """The keyword arguments that hand `process_set` to a commsched collective (none for the global set)."""
    if is_global(process_set):
        return {}
    if not _CORE:
        add_process_set(process_set)  # raises, naming what is missing
    return {"process_set": process_set}


def set_size(process_set: Any) -> int:
    """The number of ranks in `process_set`."""
    return commsched.size() if is_global(process_set) else int(process_set.size())


def set_rank(process_set: Any) -> int:
    """This process's rank within `process_set`."""
    return commsched.rank() if is_global(process_set) else int(process_set.rank())


def ranks_of(process_set: Any) -> Sequence[int]:
    """The global ranks in `process_set`, in order."""
    if is_global(process_set):
        return range(commsched.size())
    return list(process_set.ranks)
