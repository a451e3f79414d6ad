"""Builds and runs the core microbenchmark (scheduling cost without a transport); prints a table, writes JSON."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ["types", "elementwise", "scheduler", "agreement", "agreement_report", "agreement_membership"]


def build(output: Path) -> None:
    """Compiles the microbenchmark with the core's sources at -O2."""
    sources = [str(ROOT / "benchmarks" / "core_microbench.cc")]
    sources += [str(ROOT / "csrc" / "core" / f"{name}.cc") for name in CORE]
    subprocess.run(
        ["g++", "-std=c++17", "-O2", f"-I{ROOT / 'csrc'}", *sources, "-o", str(output)], check=True
    )


def main() -> int:
    """Runs the microbenchmark."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=2000, help="tensors per simulated iteration")
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "core_microbench"
        build(binary)
        result = json.loads(
            subprocess.run(
                [str(binary), str(args.tensors), str(args.iterations)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
    rows = [
        ("scheduler, per chunk", result["scheduler_ns_per_chunk"]),
        ("agreement, per tensor per rank (2 ranks)", result["agreement_ns_per_tensor_2_ranks"]),
        ("agreement, per tensor per rank (8 ranks)", result["agreement_ns_per_tensor_8_ranks"]),
    ]
    print(f"{'what':<44}{'cost (us)':>12}")
    for label, nanoseconds in rows:
        print(f"{label:<44}{nanoseconds / 1000:>12.3f}")
    print(
        f"({result['chunks']} chunks over {result['iterations']} iterations of {result['tensors']} tensors)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
