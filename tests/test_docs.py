"""The documentation against the code: commands that run, settings that exist, links that resolve.

* Shell blocks marked with `<!-- docs-check: run -->` in README.md and docs/guide.md run on this
  machine (one rank, loopback, --help, short simulator runs) and must exit 0.
* Every COMMSCHED_* variable the code reads has a row in docs/guide.md's settings tables, and
  every variable the docs name is read somewhere.
* Relative links and images resolve; the README's headline figures and the plots' data are
  figures recorded in docs/measurements.md.
* The guide's stated defaults against commsched.config() on loopback, MPI and Gloo:
  tests/test_docs_defaults.py.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

settings_module = importlib.import_module("commsched.config")  # commsched.config is also a function


ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
MEASUREMENTS = ROOT / "docs" / "measurements.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
RUN_MARK = "<!-- docs-check: run -->"
# Where the product reads its variables (tests only set them).
CODE_PLACES = ("commsched", "plugins", "csrc", "benchmarks", "scripts", "examples", "setup.py")
CODE_SUFFIXES = {".py", ".cc", ".h", ".c", ".sh", ".proto"}
SKIPPED_DIRS = {"__pycache__", "build", ".venv", ".git"}
VARIABLE = re.compile(r"COMMSCHED_[A-Z0-9_]*[A-Z0-9](_?\*)?")
# C identifiers of the C ABI (enum members, include guards) share the prefix but are no variables.
C_DECLARATION = re.compile(r"#\s*(?:ifndef|define)\s+(COMMSCHED_\w+)|\b(COMMSCHED_\w+)\s+=\s*\d")
GUIDE_ROW = re.compile(r"^\|\s*`(COMMSCHED_[A-Z0-9_]+)`\s*\|")
COMMAND_TIMEOUT_S = 60
HISTORY_WORDING = re.compile(r"\bsessions?\b|previous try|last time|we tried|this time round", re.IGNORECASE)


def _code_files() -> list[Path]:
    """Source files of the product, without following the plug-in symlinks twice."""
    found: list[Path] = []
    for place in CODE_PLACES:
        path = ROOT / place
        if path.is_file():
            found.append(path)
            continue
        for directory, subdirectories, files in os.walk(path):
            subdirectories[:] = [
                d for d in subdirectories if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
            ]
            found += [Path(directory) / name for name in files if Path(name).suffix in CODE_SUFFIXES]
    return found


def _variables_in(paths: list[Path]) -> dict[str, list[str]]:
    """COMMSCHED_* names -> the places ("path:line") they occur, C identifiers left out."""
    places: dict[str, list[str]] = defaultdict(list)
    c_identifiers: set[str] = set()
    for path in paths:
        text = path.read_text(errors="replace")
        if path.suffix in (".h", ".c", ".cc"):
            c_identifiers.update(
                name.rstrip("_") for match in C_DECLARATION.finditer(text) for name in match.groups() if name
            )
        for number, line in enumerate(text.splitlines(), 1):
            for match in VARIABLE.finditer(line):
                if not match.group(1):  # COMMSCHED_GRPC_TLS_* names a family, not a variable
                    places[match.group(0)].append(f"{path.relative_to(ROOT)}:{number}")
    return {name: where for name, where in places.items() if name not in c_identifiers}


def _guide_rows() -> dict[str, str]:
    """Variable -> its row in docs/guide.md's settings tables."""
    rows = {}
    for line in GUIDE.read_text().splitlines():
        match = GUIDE_ROW.match(line)
        if match:
            rows[match.group(1)] = line
    return rows


def _shown(where: list[str], limit: int = 3) -> str:
    return ", ".join(where[:limit]) + (f" and {len(where) - limit} more" if len(where) > limit else "")


def test_every_variable_the_code_reads_has_a_row_in_the_guide() -> None:
    """Fails listing each undocumented variable with where the code reads it."""
    read = _variables_in(_code_files())
    rows = _guide_rows()
    missing = sorted(set(read) - set(rows))
    assert not missing, (
        "COMMSCHED_* variables the code reads but docs/guide.md's settings tables do not document "
        "(add a row: | `NAME` | default | accepted form | what it does |):\n"
        + "\n".join(f"  {name}  (read in {_shown(read[name])})" for name in missing)
    )


def test_every_documented_variable_is_read_by_the_code() -> None:
    """Fails listing each variable the docs name that no code reads (renamed or removed)."""
    read = _variables_in(_code_files())
    documented = _variables_in(DOCS)
    stale = sorted(set(documented) - set(read))
    assert not stale, (
        "COMMSCHED_* variables the docs name but nothing in "
        + ", ".join(CODE_PLACES)
        + " reads (fix the name or drop it from the docs):\n"
        + "\n".join(f"  {name}  (named in {_shown(documented[name])})" for name in stale)
    )


def test_the_guide_documents_every_setting_and_its_options() -> None:
    """Each init() setting has a guide row that lists every option a choice setting accepts."""
    rows = _guide_rows()
    problems = []
    for field, (variable, _, form) in settings_module._SPECS.items():
        row = rows.get(variable)
        if row is None:
            problems.append(f"  {variable} (init({field}=...)): no row in docs/guide.md")
            continue
        if form.startswith("one of "):
            options = [option.strip() for option in form[len("one of ") :].split(",")]
            absent = [option for option in options if f"`{option}`" not in row]
            if absent:
                problems.append(f"  {variable}: its row does not name {', '.join(absent)}")
    assert not problems, "docs/guide.md's settings tables fall short of commsched/config.py:\n" + "\n".join(
        problems
    )


def _marked_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, script) of each fenced shell block right after a docs-check: run mark."""
    lines = path.read_text().splitlines()
    blocks = []
    for index, line in enumerate(lines):
        if line.strip() != RUN_MARK:
            continue
        fence = index + 1
        assert fence < len(lines) and lines[fence].startswith("```"), (
            f"{path.relative_to(ROOT)}:{index + 1}: {RUN_MARK} must come right before a ``` block"
        )
        end = next(i for i in range(fence + 1, len(lines)) if lines[i].startswith("```"))
        blocks.append((fence + 1, "\n".join(lines[fence + 1 : end])))
    return blocks


RUNNABLE = [
    pytest.param(path, line, script, id=f"{path.name}:{line}")
    for path in (README, GUIDE)
    for line, script in _marked_blocks(path)
]


def _command_bin(directory: Path) -> Path:
    """`python` and the console scripts of pyproject.toml, running this checkout with this interpreter."""
    directory.mkdir()
    (directory / "python").symlink_to(sys.executable)
    scripts = re.search(
        r"\[project\.scripts\]\n(.*?)(?:\n\[|\Z)", (ROOT / "pyproject.toml").read_text(), re.DOTALL
    )
    assert scripts, "pyproject.toml has no [project.scripts] table"
    for name, module, function in re.findall(
        r'^([\w-]+)\s*=\s*"([\w.]+):(\w+)"', scripts.group(1), re.MULTILINE
    ):
        wrapper = directory / name
        wrapper.write_text(
            f'#!/bin/sh\nexec "{sys.executable}" -c "import sys; sys.argv[0] = \'{name}\'; '
            f'from {module} import {function}; sys.exit({function}())" "$@"\n'
        )
        wrapper.chmod(0o755)
    return directory


@pytest.mark.parametrize(("path", "line", "script"), RUNNABLE)
def test_documented_command_runs(path: Path, line: int, script: str, tmp_path: Path) -> None:
    """A block marked runnable exits 0 on one machine, run from the repository root."""
    binaries = _command_bin(tmp_path / "bin")
    environment = dict(os.environ)
    environment["PATH"] = f"{binaries}{os.pathsep}{environment.get('PATH', '')}"
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    for launcher_variable in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "PMI_RANK",
        "PMI_SIZE",
        "OMPI_COMM_WORLD_RANK",
    ):
        environment.pop(launcher_variable, None)  # one rank: loopback
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script],
        cwd=ROOT,
        env=environment,
        check=False,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{path.relative_to(ROOT)}:{line}: the documented commands exited {result.returncode}\n"
        f"{script}\n--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    )


SHELL_DOCS = (README, GUIDE, ROOT / "docs" / "architecture.md")
# Every shell line of SHELL_DOCS outside a docs-check: run block matches one of these (after its
# VARIABLE=value prefixes), with the reason it does not run in a marked block.
NOT_RUN_AS_WRITTEN = {
    r"scripts/demo\.sh\b": "needs root (network namespaces, tc tbf)",
    r"scripts/test\.sh\b": "the whole suite: CI runs it (test_readme_opens_with_the_demo_and_the_test_command)",
    r"pip install\b": "installs into the user's environment; scripts/test_wheel.sh installs in fresh venvs",
    r"commsched-info\b": "reports an installation: tests/test_install.py runs python -m commsched.info",
    r"scripts/(build_wheels|test_wheel)\.sh\b": "minutes of C++ builds and fresh venvs; measured in README.md",
    r"(mpiexec|torchrun|commsched-run|python)\b.*\btrain\.py\b": "the user's own training script",
    r"python benchmarks/(netrig|autotune_rig)\.py\b": "needs root: the shaped-link rig",
    r".*-m commsched\.bench\.cli allreduce\b": "a results-table benchmark: runs at small sizes below",
    r".*-m commsched\.bench\.cli schedule\b": "a results-table replay: tests/test_bench_schedule.py runs it under mpiexec",
    r"python benchmarks/plots\.py\s*$": "test_plots_come_from_recorded_figures runs it (with --out)",
}
SHELL_FENCE = re.compile(r"```(bash|sh|shell|console)\s*$")
ENVIRONMENT_PREFIX = re.compile(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+")


def _unmarked_shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each shell command in a block without the docs-check: run mark;
    comments dropped, backslash continuations joined."""
    lines = path.read_text().splitlines()
    found: list[tuple[int, str]] = []
    inside = marked = False
    pending = ""
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            inside = not inside and bool(SHELL_FENCE.match(line))
            marked = inside and number > 1 and lines[number - 2].strip() == RUN_MARK
            continue
        if not inside or marked:
            continue
        command = (pending + " " + line.split(" # ")[0].split("  #")[0]).strip()
        if command.endswith("\\"):
            pending = command[:-1]
            continue
        pending = ""
        if command and not command.startswith("#"):
            found.append((number, command))
    return found


def test_every_one_machine_command_runs_or_says_why_not() -> None:
    """Each shell command in README.md, docs/guide.md and docs/architecture.md runs in a marked
    block or matches NOT_RUN_AS_WRITTEN (root, a rig, an installation, the user's script, a benchmark
    run smaller here)."""
    unexplained = [
        f"  {path.relative_to(ROOT)}:{number}: {command}"
        for path in SHELL_DOCS
        for number, command in _unmarked_shell_lines(path)
        if not any(re.match(pattern, ENVIRONMENT_PREFIX.sub("", command)) for pattern in NOT_RUN_AS_WRITTEN)
    ]
    assert not unexplained, (
        f"shell commands neither in a {RUN_MARK} block nor named in NOT_RUN_AS_WRITTEN with why:\n"
        + "\n".join(unexplained)
    )


BENCHMARK_RUNS = [
    pytest.param(command, id=f"README.md:{number}")
    for number, command in _unmarked_shell_lines(README)
    if "-m commsched.bench.cli allreduce" in command
]
# Small sizes for the results table's allreduce benchmarks: the documented launcher, module and
# transport, a few seconds each.
SHRINK = ((r"-e \S+", "-b 4 -e 4KiB"), (r"-f \d+", "-f 32"), (r"--repeats \d+", "--repeats 1 -n 3 -w 1"))


@pytest.mark.parametrize("command", BENCHMARK_RUNS)
def test_results_benchmark_commands_run_at_small_sizes(command: str) -> None:
    """The README's one-machine allreduce benchmarks (MPI, gRPC, Gloo) run as written, with small sizes."""
    for pattern, replacement in SHRINK:
        command, replaced = re.subn(pattern, replacement, command)
        assert replaced == 1, f"{pattern!r} not in {command!r}: update SHRINK"
    environment = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(("COMMSCHED_", "PMI_", "PMIX_", "OMPI_"))
        and name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    # This venv's python, mpiexec and torchrun (a python symlinked elsewhere would leave the venv).
    environment["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), environment["PATH"]])
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    environment["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", command],
        cwd=ROOT,
        env=environment,
        check=False,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    assert re.search(r"^\s*4096\s", result.stdout, re.MULTILINE), result.stdout[-2000:]  # the last size


def test_readme_opens_with_the_demo_and_the_test_command() -> None:
    """CI runs the test command the README names first; both scripts exist."""
    text = README.read_text()
    first_block = re.search(r"```\w*\n(.*?)```", text, re.DOTALL)
    assert first_block, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines()]
    assert commands[:2] == ["scripts/demo.sh", "scripts/test.sh"], commands
    for script in commands[:2]:
        assert os.access(ROOT / script, os.X_OK), f"{script} is not an executable file"
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text(), ".ci/run must run scripts/test.sh"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_and_images_resolve() -> None:
    """Every relative link and image target exists, and every #anchor names a heading there."""
    broken = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue  # https:, mailto:
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                if not linked.exists():
                    broken.append(f"  {path.relative_to(ROOT)}:{number}: {target} (no such file)")
                elif anchor and linked.suffix == ".md":
                    headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.MULTILINE)
                    if anchor not in {_slug(heading) for heading in headings}:
                        broken.append(f"  {path.relative_to(ROOT)}:{number}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _recorded_figures() -> set[float]:
    return {float(number) for number in re.findall(r"(?<![\w.])\d+\.\d+", MEASUREMENTS.read_text())}


def test_readme_results_are_recorded_figures() -> None:
    """Every decimal figure in the README's results table appears in docs/measurements.md."""
    text = README.read_text()
    section = text.split("## Results", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("|"))
    figures = {float(number) for number in re.findall(r"(?<![\w.])\d+\.\d+", table)}
    unrecorded = sorted(figures - _recorded_figures())
    assert figures and not unrecorded, f"README figures not in docs/measurements.md: {unrecorded}"


def test_plots_come_from_recorded_figures(tmp_path: Path) -> None:
    """benchmarks/plots.py redraws the README's plots from figures docs/measurements.md records."""
    data = ROOT / "docs" / "data" / "headline.json"
    figures = {float(n) for n in re.findall(r"(?<![\w.\"])\d+\.\d+", data.read_text())}
    unrecorded = sorted(figures - _recorded_figures())
    assert not unrecorded, f"{data.relative_to(ROOT)} has figures docs/measurements.md lacks: {unrecorded}"
    pytest.importorskip("matplotlib")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plots.py"), "--out", str(tmp_path)],
        check=False,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    images = re.findall(r"!\[[^\]]*\]\((docs/img/[\w.-]+\.png)\)", README.read_text())
    assert images, "the README shows no plot"
    for image in images:
        assert (tmp_path / Path(image).name).stat().st_size > 0, f"plots.py does not draw {image}"
        assert (ROOT / image).stat().st_size < 100 * 1024, f"{image} is over 100 KB"


def test_docs_speak_of_the_product_not_of_its_making() -> None:
    """README.md and docs/ describe the product, not the history of the work on it."""
    hits = [
        f"  {path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in DOCS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if HISTORY_WORDING.search(line)
    ]
    assert not hits, "reword as facts about the product:\n" + "\n".join(hits)


# -- The guide's settings tables against the code: messages, figures (defaults: test_docs_defaults.py)


def test_the_guides_quoted_setting_error_is_the_real_one() -> None:
    """The errors table quotes the SettingError a bad COMMSCHED_POLICY gives, word for word."""
    with pytest.raises(settings_module.SettingError) as caught:
        settings_module.resolve({}, {"COMMSCHED_POLICY": "lifo"})
    quoted = f"`SettingError: {caught.value}`"
    assert quoted in GUIDE.read_text(), f"docs/guide.md's errors table should quote {quoted}"


def test_setting_errors_name_settings_not_functions() -> None:
    """The accepted forms a SettingError gives name COMMSCHED_* variables and values, never one of
    commsched's Python functions (the user cannot set a function)."""
    functions = set()
    for path in (ROOT / "commsched").glob("*.py"):
        functions.update(re.findall(r"^def (\w+)\(", path.read_text(), re.MULTILINE))
    named = [
        f"  {variable}: {function}"
        for variable, _, form in [
            *settings_module._SPECS.values(),
            *settings_module.CHECKPOINT_SPECS.values(),
        ]
        for function in sorted(functions)
        if "_" in function and re.search(rf"\b{function}\b", form)
    ]
    assert not named, "SettingError forms that name functions:\n" + "\n".join(named)


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    start = text.index(heading + "\n")
    following = re.search(rf"^#{{1,{level}}} ", text[start + len(heading) :], re.MULTILINE)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


FIGURE = re.compile(
    r"(?<![\w.])\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?(?: ?(?:µs|ms|GB/s|Gbit/s))|(?<![\w.])\d+\.\d+-\d+\.\d+"
)
COMMIT = re.compile(r"`([0-9a-f]{7,40})`")


def test_the_guides_transport_figures_are_recorded() -> None:
    """The figures the guide's transport table quotes (times, rates, ratios) are recorded in
    docs/measurements.md on one line with the commit the row cites. docs/data/ holds no transport
    figures (only the headline MPI allreduce, the replays and the simulator's defaults), so
    measurements.md is the record checked."""
    table = [
        line for line in _section(GUIDE.read_text(), "## Transports").splitlines() if line.startswith("| `")
    ]
    recorded = MEASUREMENTS.read_text().splitlines()
    problems = []
    quoted = 0
    for row in table:
        figures = [match.group(0) for match in FIGURE.finditer(row)]
        if not figures:
            continue
        quoted += 1
        commits = COMMIT.findall(row)
        if not commits:
            problems.append(f"  {row[:60]}...: quotes {figures} but cites no commit")
            continue
        lines = [line for line in recorded if any(commit in line for commit in commits)]
        missing = [figure for figure in figures if not any(figure in line for line in lines)]
        if missing:
            problems.append(f"  {row[:60]}...: {missing} not recorded with {', '.join(commits)}")
    assert quoted, "the guide's transport table quotes no measured figure"
    assert not problems, "transport figures in docs/guide.md not in docs/measurements.md:\n" + "\n".join(
        problems
    )


def test_tables_have_no_blank_line_inside() -> None:
    """A blank line between two rows of a Markdown table ends the table: the rows after it show as text."""
    broken = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for index in range(1, len(lines) - 1):
            if (
                lines[index].strip()
                or not lines[index - 1].startswith("|")
                or not lines[index + 1].startswith("|")
            ):
                continue
            starts_table = index + 2 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[index + 2].strip())
            if not starts_table:
                broken.append(f"  {path.relative_to(ROOT)}:{index + 1}")
    assert not broken, "blank lines inside tables:\n" + "\n".join(broken)


def _command_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """The argument parsers of commsched-bench (and its subcommands), commsched-sim and commsched-run."""
    from commsched import run
    from commsched.bench import cli, sim_cli

    bench = cli._parser()
    parsers = [("commsched-bench", bench)]
    for action in bench._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers += [(f"commsched-bench {name}", parser) for name, parser in action.choices.items()]
    return parsers + [("commsched-sim", sim_cli._parser()), ("commsched-run", run._parser("commsched-run"))]


def test_every_cli_option_has_help() -> None:
    """Each option and argument of the three commands says what it does in --help (a renamed flag,
    kept only to be refused with its new name, is hidden)."""
    parsers = _command_parsers()
    assert len(parsers) == 5, [name for name, _ in parsers]
    missing = [
        f"  {name}: {'/'.join(action.option_strings) or action.dest}"
        for name, parser in parsers
        for action in parser._actions
        if action.help is None or not str(action.help).strip()
    ]
    assert not missing, "options without help:\n" + "\n".join(missing)


def test_commsched_run_names_itself() -> None:
    """commsched-run's usage names commsched-run, however it was started."""
    from commsched import run

    assert run._prog("/venv/bin/commsched-run") == "commsched-run"
    for started_as in ("/repo/commsched/run.py", "-c", "-m", ""):
        assert run._prog(started_as) == "commsched-run"
    result = subprocess.run(
        [sys.executable, "-m", "commsched.run", "--help"],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: commsched-run "), result.stdout[:200]
    assert "python -m commsched.run [" not in result.stdout
