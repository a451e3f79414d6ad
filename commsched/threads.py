"""A function run on a thread of its own, for work beside the training loop (and for tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(
    target: Callable[..., Any],
    args: tuple[Any, ...] = (),
    name: str | None = None,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Starts `target(*args)` on a new (by default daemon) thread and returns it.

    `silent=True` swallows an exception the target raises, for work whose failure must not print.
    """
    if not callable(target):
        raise TypeError(f"in_thread needs a callable target, not {target!r}")
    if not isinstance(args, tuple):
        raise TypeError(f"in_thread takes args as a tuple, not {type(args).__name__}")

    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run if silent else target, args=() if silent else args, name=name)
    thread.daemon = daemon
    thread.start()
    return thread
