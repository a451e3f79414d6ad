"""`commsched-bench`: how fast is my transport (allreduce), and what does scheduling buy my model (schedule)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from commsched.bench import allreduce, schedule


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commsched-bench",
        description=__doc__.split(":", 1)[1].strip(),
        epilog="Launch on the ranks to measure, e.g. mpiexec -n 2 commsched-bench allreduce -e 64MiB",
    )
    commands = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="allreduce or schedule (COMMAND --help for its flags)",
    )
    allreduce.add_arguments(commands.add_parser("allreduce", help="allreduce table against the raw library"))
    schedule.add_arguments(commands.add_parser("schedule", help="replay a model's training step per policy"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of commsched-bench."""
    args = _parser().parse_args(argv)
    if args.command == "allreduce":
        return allreduce.run(args)
    return schedule.run(args)


if __name__ == "__main__":
    sys.exit(main())
