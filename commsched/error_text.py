"""Errors shown inside commsched's own messages."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none (torch's and Gloo's
    errors carry C++ backtraces after it)."""
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
