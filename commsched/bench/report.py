"""Output of the benchmark commands: aligned tables, JSON, plots and a terminal progress bar."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

Column = tuple[str, str, str]  # (key, header, format spec)


def human_size(nbytes: float) -> str:
    """A byte count as B, KiB, MiB or GiB."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor:
            value = nbytes / factor
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{int(nbytes)}B"


def format_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    """Right-aligned text table; a missing or None value prints as '-'."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key)
            line.append("-" if value is None else format(value, spec) if spec else str(value))
        cells.append(line)
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    text = ["  ".join(cell.rjust(width) for cell, width in zip(line, widths)) for line in cells]
    text.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(text)


def text_stream(json_path: str | None) -> TextIO:
    """Where a command prints its header and table: stdout, unless `--json -` claims stdout for the
    JSON alone (then stderr, so `... --json - | jq` reads nothing but JSON)."""
    return sys.stderr if json_path == "-" else sys.stdout


def dump_json(payload: Any, path: str) -> None:
    """Writes JSON to `path`, or to stdout when path is '-' (print the text to text_stream(path))."""
    text = json.dumps(payload, indent=2, sort_keys=False)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as out:
            out.write(text + "\n")


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # no display on a training node
    import matplotlib.pyplot as plt

    return plt


def plot_allreduce(rows: Sequence[dict[str, Any]], path: str, title: str) -> None:
    """Bus bandwidth of commsched and the raw library against message size."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    sizes = [row["size"] for row in rows]
    axis.plot(sizes, [row["busbw"] for row in rows], "o-", label="commsched")
    axis.plot(sizes, [row["raw_busbw"] for row in rows], "s--", label="raw")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("message size (bytes)")
    axis.set_ylabel("busbw (GB/s)")
    axis.set_title(title)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_iterations(rows: Sequence[dict[str, Any]], path: str, title: str, label_keys: Sequence[str]) -> None:
    """Iteration time per configuration as bars, with the bound and the best schedule as lines."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(max(6, 0.9 * len(rows) + 2), 4))
    labels = ["\n".join(str(row[key]) for key in label_keys) for row in rows]
    positions = list(range(len(rows)))
    axis.bar(positions, [row["iteration_s"] * 1e3 for row in rows], color="tab:blue", label="iteration")
    for key, style, name in (
        ("bound_s", "k--", "max(compute, comm)"),
        ("best_s", "g-", "best schedule"),
        ("sum_s", "r:", "compute + comm"),
    ):
        values = [row.get(key) for row in rows]
        if all(value is not None for value in values):
            axis.plot(positions, [value * 1e3 for value in values], style, marker="_", label=name)
    axis.set_xticks(positions, labels, fontsize=8)
    axis.set_ylabel("ms")
    axis.set_title(title)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


class Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(
        self, total: int, label: str, stream: TextIO | None = None, enabled: bool | None = None
    ) -> None:
        self.total, self.label, self.done = max(1, total), label, 0
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.started = time.monotonic()

    def step(self, note: str = "") -> None:
        """Counts one unit of work done and redraws."""
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // self.total
        elapsed = time.monotonic() - self.started
        bar = "#" * filled + "." * (width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.1f}s {note:<12}")
        if self.done >= self.total:
            self.stream.write("\n")
        self.stream.flush()


def timing_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The row with the columns every policy/mode table shows: times in ms and the hidden share in %."""
    return dict(
        row,
        iteration_ms=row["iteration_s"] * 1e3,
        bound_ms=row["bound_s"] * 1e3,
        best_ms=row["best_s"] * 1e3,
        sum_ms=row["sum_s"] * 1e3,
        hidden_pct=row["hidden"] * 100,
    )
