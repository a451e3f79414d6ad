"""Rank script: runs other rank scripts one after another in this process.

`in_turn.py DIR/horovod_collectives.py DIR/horovod_autograd.py` runs each script's main() (its own
init() to shutdown()), so a launch pays Python's and torch's (or TensorFlow's) start-up once for
several scripts. Each script's "PASS <check>" and "FAIL <check>" lines come out as
"PASS <script>/<check>" (<script>: the file's name without .py), since two scripts may name a check
alike. A script that raises ends the run: the ranks would no longer agree on what comes next. Exits 1
when any script failed. Tests judge one script's lines of such a launch with check_script().
"""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path
from typing import TextIO


class _Labelled:
    """stdout that names the script in each PASS and FAIL line written through it."""

    def __init__(self, stream: TextIO, script: str) -> None:
        self._stream = stream
        self._script = script
        self._line_start = True  # print() writes its arguments and the newline in separate calls

    def write(self, text: str) -> int:
        """Writes `text`, "PASS x" and "FAIL x" at a line's start becoming "PASS script/x"."""
        lines = text.split("\n")
        for index, line in enumerate(lines):
            if index == 0 and not self._line_start:
                continue
            for marker in ("PASS ", "FAIL "):
                if line.startswith(marker):
                    lines[index] = f"{marker}{self._script}/{line[len(marker) :]}"
        if text:
            self._line_start = text.endswith("\n")
        self._stream.write("\n".join(lines))
        return len(text)

    def flush(self) -> None:
        """Flushes the real stdout."""
        self._stream.flush()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


def check_script(
    returncode: int,
    passes: list[str],
    failures: list[str],
    script: str,
    expected: list[str],
    ranks: int,
    tail: str,
) -> None:
    """Asserts that `script`'s checks all passed on each of `ranks` ranks and none failed, and that the
    launch ended well unless another script failed. `passes` and `failures`: the labels of the
    launch's PASS and FAIL lines ("script/check ..."); `tail`: the output the assertions show."""
    mine = f"{script}/"
    assert not [failure for failure in failures if failure.startswith(mine)], tail
    assert returncode == 0 or failures, tail
    passed = [label.removeprefix(mine) for label in passes if label.startswith(mine)]
    assert sorted(passed) == sorted(label for label in expected for _ in range(ranks)), tail


def main() -> int:
    """Runs the scripts named on the command line in turn; 1 if any failed."""
    failed = 0
    real = sys.stdout
    for path in map(Path, sys.argv[1:]):
        script = path.stem
        if str(path.parent) not in sys.path:  # the script's helpers sit beside it
            sys.path.insert(0, str(path.parent))
        sys.stdout = _Labelled(real, script)
        try:
            failed |= importlib.import_module(script).main() not in (None, 0)
        except Exception:  # noqa: BLE001 - report which script stopped the run, then stop
            print(f"FAIL {script}/raised\n{traceback.format_exc()}", flush=True)
            return 1
        finally:
            sys.stdout = real
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
