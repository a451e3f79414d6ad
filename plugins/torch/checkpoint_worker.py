"""The Checkpointer's background side: one save in progress, the thread that completes saves in order.

The thread runs at a lower OS priority than training and the core's thread, so writing a version
takes what they leave; at exit the last save is waited for, so a version started is not lost.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commsched.torch import checkpoint_format as fmt
from commsched.torch.checkpoint_capture import Capture

import commsched
import torch


@dataclass(eq=False)
class Job:
    """One save() in progress."""

    step: int
    path: Path
    capture: Capture
    pieces: list[list[fmt.Piece]]
    placed: list[tuple[fmt.Piece, int]]
    buffer: torch.Tensor
    manifest: dict[str, Any]
    state_values: dict[str, dict[str, Any]] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    durable_after: float | None = None  # seconds from save() to a complete version


def now_us() -> int:
    """Microseconds of the wall clock."""
    return time.time_ns() // 1000  # wall clock, like the core's timeline


def trace(name: str, start_us: int, args: str = "{}") -> None:
    """A span on the timeline's "checkpoint" track (COMMSCHED_TIMELINE), if tracing."""
    span = getattr(commsched._core, "timeline_span", None)
    if span is not None and commsched.is_initialized():
        span("checkpoint", name, start_us, max(now_us() - start_us, 1), args)


def lower_priority() -> None:
    """Lowers the calling thread's OS priority (Linux; elsewhere nothing)."""
    try:  # Linux: a thread's nice value is its own; the core's thread and training go first
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


def work(owner: weakref.ref[Any], jobs: queue.Queue[Job | None]) -> None:
    """The worker thread: completes each queued save in order until it gets None."""
    lower_priority()
    while True:
        job = jobs.get()
        if job is None:
            return
        checkpointer = owner()
        try:
            if checkpointer is not None:
                checkpointer._complete(job)
        except Exception as error:  # noqa: BLE001 - a failed collective: the job is over anyway
            job.error = job.error or error
        finally:
            del checkpointer
            job.done.set()


def finish_at_exit(owner: weakref.ref[Any]) -> None:
    """At exit: waits for the save in progress, warning instead of raising."""
    checkpointer = owner()
    if checkpointer is not None and checkpointer._job is not None:
        try:
            checkpointer.wait()
        except Exception as error:  # noqa: BLE001 - at exit there is nobody left to raise to
            warnings.warn(str(error), RuntimeWarning, stacklevel=1)
