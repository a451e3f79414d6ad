#!/usr/bin/env python3
"""Draws the README's headline plots from recorded figures (docs/data/headline.json).

    python benchmarks/plots.py                      # writes docs/img/{demo,replay,allreduce}.png
    python benchmarks/plots.py --out /tmp/plots     # somewhere else

Each plot carries the date, commit and command its figures were measured with, taken from the
JSON, so a plot never drifts from the table in docs/measurements.md it illustrates.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "docs" / "data" / "headline.json"
DEFAULT_OUT = ROOT / "docs" / "img"
_SIZE = (6.4, 3.4)
_DPI = 90  # keeps each PNG well under 100 KB


def _pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots.py needs matplotlib: pip install 'commsched[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _footer(figure: Any, record: dict[str, Any]) -> None:
    """States where the figures come from, under the axes."""
    figure.text(
        0.01,
        0.01,
        f"{record['date']}, commit {record['commit']}: {record['command']}",
        fontsize=5.5,
        color="0.35",
    )


def _save(figure: Any, path: Path) -> None:
    figure.tight_layout(rect=(0, 0.04, 1, 1))
    figure.savefig(path, dpi=_DPI)


def plot_demo(record: dict[str, Any], path: Path) -> None:
    """Iteration time per variant, one bar per run."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=_SIZE)
    variants = record["variants"]
    runs = len(record["runs"])
    width = 0.8 / runs
    for run in range(runs):
        positions = [index + (run - (runs - 1) / 2) * width for index in range(len(variants))]
        values = [variant["ms"][run] for variant in variants]
        axis.bar(positions, values, width, label=record["runs"][run])
        for x, value in zip(positions, values):
            axis.text(x, value, f"{value:.0f}", ha="center", va="bottom", fontsize=7)
    axis.set_xticks(range(len(variants)), [v["label"].replace(", ", "\n") for v in variants], fontsize=8)
    axis.set_ylabel(record["unit"])
    axis.set_title(record["title"], fontsize=9)
    axis.legend(fontsize=7, loc="lower left")
    _footer(figure, record)
    _save(figure, path)
    plt.close(figure)


def plot_replay(record: dict[str, Any], path: Path) -> None:
    """Speedup over fifo+barrier per model and rank count; the whisker spans the runs."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=_SIZE)
    models = list(record["cells"])
    ranks = sorted({r for cells in record["cells"].values() for r in cells}, key=int)
    width = 0.8 / len(ranks)
    for slot, rank in enumerate(ranks):
        positions = [index + (slot - (len(ranks) - 1) / 2) * width for index in range(len(models))]
        cells = [record["cells"][model][rank] for model in models]
        low = [cell["min"] for cell in cells]
        high = [cell["max"] - cell["min"] for cell in cells]
        axis.bar(positions, low, width, yerr=[[0] * len(cells), high], capsize=2, label=f"{rank} ranks")
    axis.axhline(1.0, color="k", linewidth=0.8)
    axis.set_ylim(0.9, max(cell["max"] for m in models for cell in record["cells"][m].values()) + 0.08)
    axis.set_xticks(range(len(models)), models, fontsize=8)
    axis.set_ylabel(record["unit"])
    axis.set_title(record["title"] + " (bar: lowest run, whisker: highest)", fontsize=9)
    axis.legend(fontsize=7, ncols=len(ranks))
    _footer(figure, record)
    _save(figure, path)
    plt.close(figure)


def plot_allreduce(record: dict[str, Any], path: Path) -> None:
    """commsched against raw MPI by message size: time ratio for small sizes, busbw ratio for large."""
    plt = _pyplot()
    figure, (small, large) = plt.subplots(1, 2, figsize=_SIZE)
    for axis, key, label, good in (
        (small, "time_over_raw", "time / raw (lower is better)", "below 1: faster than raw"),
        (large, "busbw_over_raw", "busbw / raw (higher is better)", "above 1: more bandwidth than raw"),
    ):
        sizes = list(record[key])
        lows = [record[key][size][0] for size in sizes]
        highs = [record[key][size][1] for size in sizes]
        axis.vlines(range(len(sizes)), lows, highs, linewidth=6, color="tab:blue")
        axis.axhline(1.0, color="k", linewidth=0.8)
        axis.set_xticks(range(len(sizes)), sizes, fontsize=7, rotation=30)
        axis.set_ylabel(label, fontsize=8)
        axis.set_title(good, fontsize=8)
        if max(highs) > 2:  # 64 MiB's 2.7-2.9 would flatten the rows near 1 on a linear axis
            axis.set_yscale("log")
            axis.set_yticks([0.9, 1.0, 1.2, 1.5, 2.0, 3.0], ["0.9", "1.0", "1.2", "1.5", "2.0", "3.0"])
            axis.minorticks_off()
    figure.suptitle(f"{record['title']} ({record['runs']} runs: range)", fontsize=9)
    _footer(figure, record)
    _save(figure, path)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Writes every plot the README shows."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="recorded figures (JSON)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the PNGs")
    args = parser.parse_args(argv)
    recorded = json.loads(args.data.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    for name, draw in (("demo", plot_demo), ("replay", plot_replay), ("allreduce", plot_allreduce)):
        target = args.out / f"{name}.png"
        draw(recorded[name], target)
        print(f"{target} ({target.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
