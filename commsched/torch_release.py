"""Which installed torch a native part built against another torch build may load into."""

from __future__ import annotations


def release(version: str) -> str:
    """torch's version without its local build label: '2.13.0+cu130' -> '2.13.0'."""
    return version.split("+", 1)[0]


def fits(built_for: str, installed: str) -> bool:
    """True when a part built against torch `built_for` may load into torch `installed`.

    c10d's and autograd's C++ classes change between releases, so the release must match. The local
    label does not matter: the parts use torch's CPU classes only, which every build of a release
    (+cpu, +cu130, ...) shares, so one wheel serves PyPI's CUDA torch and the CPU index's alike.
    """
    return bool(built_for) and release(built_for) == release(installed)
