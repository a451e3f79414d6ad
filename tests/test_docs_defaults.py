"""Every default docs/guide.md's settings tables state, against what commsched.config() shows with no
COMMSCHED_* variable set: in one process on loopback, on 2 ranks under mpiexec (MPI) and on 2 ranks
under commsched-run (Gloo).

A default cell states a value when it starts with one in backticks (`1ms`), or, at one rank, when a
value in backticks sits in a clause for one rank ("`0` at one rank", "`1MiB` where no link is
known", "`4KiB` where nothing is measured"). A cell that starts with off, unset or none, or only
describes what happens when the setting is left unset, must find config() showing it unset (None or
""). At 2 ranks the sizes fitted to the measured link are checked against the rule their rows state
(LINK_RULES); the fitted rule's own arithmetic is tests/test_link_defaults.py's. The bucket size and
the poll interval are applied past config() (by the torch plug-in, by the core for its transport), so
config() must show them unset everywhere.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from mpirun import clean_rank_env, local_launch, mpiexec
from test_docs import _guide_rows, settings_module

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 60
PROGRAM = (
    "import json, commsched\n"
    "commsched.init()\n"
    "print('CONFIG ' + json.dumps({'rank': commsched.rank(), **commsched.config()}), flush=True)\n"
    "commsched.shutdown()\n"
)

# Phrases that mark, inside a default that depends on the link, the value at one rank on loopback.
ONE_RANK_CLAUSE = re.compile(
    r"`([^`]+)`(?:[^;`|]*?)\b(?:at one rank|where no link is known|where nothing is measured)\b"
    r"|\b(?:at one rank)[^;`|]*?`([^`]+)`"
)
# What `auto` chose, shown by config(), and the words of the row that must name that choice.
CHOSEN_TRANSPORT = {
    "loopback": "loopback for one rank",
    "mpi": "MPI under `mpiexec`",
    "gloo": "Gloo under torchrun",
}
UNSET_WORDS = ("off", "unset", "none")
MIB = 1024**2
KIB = 1024


def _default_cells() -> dict[str, str]:
    """Variable -> the default column of its row in docs/guide.md's settings tables."""
    cells = {}
    for variable, row in _guide_rows().items():
        columns = [cell.strip() for cell in row.strip().strip("|").split("|")]
        cells[variable] = columns[1]
    return cells


def _parsed(text: str, parse: Callable[[str], object]) -> tuple[bool, object]:
    try:
        return True, parse(text)
    except (TypeError, ValueError):
        return False, None


def _stated(cell: str, parse: Callable[[str], object], one_rank: bool) -> tuple[bool, object]:
    """(True, value) when the default cell states a value (at one rank: also in a one-rank clause);
    (False, None) when it describes what happens left unset."""
    if cell.lower().startswith(UNSET_WORDS):
        return False, None
    first = re.match(r"`([^`]+)`", cell)
    if first:
        found, value = _parsed(first.group(1), parse)
        if found:
            return True, value
    if one_rank:
        for match in ONE_RANK_CLAUSE.finditer(cell):
            found, value = _parsed(match.group(1) or match.group(2), parse)
            if found:
                return True, value
    return False, None


def _power_of_two(n: object) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _overhead_floor(config: dict) -> int:
    """COMMSCHED_COLLECTIVE_OVERHEAD's row: the power of two (nearest, in log scale) whose wire time is
    32 x the per-collective overhead, on the link config() shows."""
    target = 32 * config["link_bandwidth"] * (config["collective_overhead"] + config["link_message_cost"])
    return min(64 * MIB, 2 ** round(math.log2(target))) if target > 0 else 0  # the largest partition


def _partition(config: dict) -> str | None:
    partition = config["partition_bytes"]
    if not (_power_of_two(partition) and 256 * KIB <= partition <= 64 * MIB):
        return f"{partition} is not a power of two from 256 KiB to 64 MiB"
    if partition < _overhead_floor(config):
        return f"{partition} is under the collective overhead's floor {_overhead_floor(config)}"
    return None


def _credit(config: dict) -> str | None:
    credit, partition = config["credit_bytes"], config["partition_bytes"]
    if credit % partition or not (_power_of_two(credit // partition) and 4 <= credit // partition <= 64):
        return f"{credit} is not 4 to 64 partitions of {partition}"
    return None


def _fusion(config: dict) -> str | None:
    expected = max(4 * MIB, _overhead_floor(config))
    overhead = config["collective_overhead"] + config["link_message_cost"]
    if overhead > 0 and config["link_bandwidth"] >= 1.25e9:  # 10 Gbit/s: the copy cap's row
        expected = min(expected, 64 * MIB, 2 ** round(math.log2(overhead * 10e9 / 2)))
    return None if config["fusion_bytes"] == expected else f"{config['fusion_bytes']}, not {expected}"


def _inline(config: dict) -> str | None:
    share = min(64 * KIB, 256 * KIB // config["size"])
    expected = 1 << (share.bit_length() - 1)  # the core's cap, which the fitted credit reaches
    return None if config["inline_bytes"] == expected else f"{config['inline_bytes']}, not {expected}"


def _measured(field: str) -> Callable[[dict], str | None]:
    def check(config: dict) -> str | None:
        value = config[field]
        return None if isinstance(value, float) and value > 0 else f"{value!r} is no measured figure"

    return check


def _message_cost(config: dict) -> str | None:
    value = config["link_message_cost"]
    return None if isinstance(value, float) and value >= 0 else f"{value!r} is no measured figure"


# Variable -> (words its row must say, the check of config() at 2 ranks on MPI and Gloo).
LINK_RULES: dict[str, tuple[tuple[str, ...], Callable[[dict], str | None]]] = {
    "COMMSCHED_PARTITION_BYTES": (("a power of two from 256 KiB to 64 MiB",), _partition),
    "COMMSCHED_CREDIT_BYTES": (("4 to 64 partitions",), _credit),
    "COMMSCHED_FUSION_BYTES": (
        (
            "the link rule's `4MiB` at 2 or more ranks where the link is known",
            "on links of 10 Gbit/s and more (one host's shared memory) at most the size whose copies into and out of the fused buffer at 10 GB/s take that cost per collective",
        ),
        _fusion,
    ),
    "COMMSCHED_INLINE_BYTES": (
        ("64 KiB up to 4 ranks", "the cap with the fitted credit (64 KiB at 2-4 ranks"),
        _inline,
    ),
    "COMMSCHED_LINK_BANDWIDTH": (
        ("measured at `init()` over MPI and Gloo at 2 or more ranks",),
        _measured("link_bandwidth"),
    ),
    "COMMSCHED_LINK_LATENCY": (("measured with the bandwidth",), _measured("link_latency")),
    "COMMSCHED_LINK_MESSAGE_COST": (
        ("measured with the bandwidth where 1 MiB takes under 2 ms",),
        _message_cost,
    ),
}
# The floor _overhead_floor computes, as COMMSCHED_COLLECTIVE_OVERHEAD's row states it.
FLOOR_RULE = "partition and fusion are at least the power of two that keeps this cost under 1/32"
# Rank 0's measured link goes to every rank, so all fit the same sizes.
SAME_ON_EVERY_RANK = ("link_bandwidth", "link_latency", "partition_bytes", "credit_bytes", "fusion_bytes")


def _configs(transport: str, tmp_path: Path) -> list[dict]:
    """config() of every rank, rank order, with no COMMSCHED_* variable set."""
    program = tmp_path / "show_config.py"
    program.write_text(PROGRAM)
    env = clean_rank_env(ROOT)
    if transport == "loopback":
        command = [sys.executable, str(program)]
    elif transport == "mpi":
        launcher = mpiexec()
        assert launcher, "mpiexec not found: pip install mpich mpi4py"
        command = [launcher, "-n", "2", sys.executable, "-m", "mpi4py", str(program)]
    else:
        pytest.importorskip("torch")
        command = local_launch(2, str(program))
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    # mpiexec may glue two ranks' lines together.
    lines = done.stdout.replace("CONFIG ", "\nCONFIG ").splitlines()
    shown = [json.loads(line[len("CONFIG ") :]) for line in lines if line.startswith("CONFIG ")]
    return sorted(shown, key=lambda config: config["rank"])


@pytest.mark.parametrize("transport", ["loopback", "mpi", "gloo"])
def test_the_guides_defaults_are_what_config_shows(transport: str, tmp_path: Path) -> None:
    """Every default the guide's settings tables state is what commsched.config() shows on `transport`
    with nothing set, on every rank; the Checkpointer's defaults are CHECKPOINT_DEFAULTS."""
    configs = _configs(transport, tmp_path)
    size = 1 if transport == "loopback" else 2
    assert [config["rank"] for config in configs] == list(range(size)), configs
    rows, cells = _guide_rows(), _default_cells()
    specs = {variable: (field, parse, None) for field, (variable, parse, _) in settings_module._SPECS.items()}
    if transport == "loopback":
        specs.update(
            {
                variable: (name, parse, settings_module.CHECKPOINT_DEFAULTS)
                for name, (variable, parse, _) in settings_module.CHECKPOINT_SPECS.items()
            }
        )
    problems = []
    if size > 1 and FLOOR_RULE not in rows["COMMSCHED_COLLECTIVE_OVERHEAD"]:
        problems.append(
            f"  COMMSCHED_COLLECTIVE_OVERHEAD's row no longer says {FLOOR_RULE!r}: update it here"
        )
    for config in configs:
        assert config["transport"] == transport and config["size"] == size, config
        for variable, (field, parse, static) in specs.items():
            if variable not in cells:
                continue  # a missing row is test_docs' test_the_guide_documents_every_setting_and_its_options'
            actual = (static or config)[field]
            where = f"  rank {config['rank']}: {variable}:"
            if size > 1 and variable in LINK_RULES:
                words, check = LINK_RULES[variable]
                unsaid = [phrase for phrase in words if phrase not in rows[variable]]
                failed = check(config)
                if unsaid:
                    problems.append(f"{where} the row no longer says {unsaid}: update LINK_RULES")
                elif failed:
                    problems.append(f"{where} the guide's rule {words[0]!r} does not hold: {failed}")
                continue
            stated, value = _stated(cells[variable], parse, one_rank=size == 1)
            if field == "transport" and stated and value == "auto":
                if CHOSEN_TRANSPORT[transport] not in rows[variable]:
                    problems.append(
                        f"{where} `auto` chose {actual!r}; the row must say {CHOSEN_TRANSPORT[transport]!r}"
                    )
            elif stated and value != actual:
                problems.append(
                    f"{where} the guide gives {value!r}, config() shows {actual!r} ({cells[variable][:100]})"
                )
            elif not stated and actual not in (None, ""):
                problems.append(
                    f"{where} config() shows {actual!r}, but the guide's default states no value "
                    f"{'for one rank' if size == 1 else 'at 2 ranks'} ({cells[variable][:100]})"
                )
    for field in SAME_ON_EVERY_RANK:
        if len({config[field] for config in configs}) > 1:
            problems.append(f"  {field} differs between ranks: {[config[field] for config in configs]}")
    assert not problems, f"docs/guide.md's defaults against commsched.config() on {transport}:\n" + "\n".join(
        problems
    )
