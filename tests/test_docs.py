"""The pages a user reads (README.md, docs/*.md) say only what runs.

Every shell command in a fenced ```bash, ```sh or ```console block is checked without running
it: `hvd-cpu` command lines parse against the real click commands (subcommands, options,
choices, ranges), horovodrun's options against horovodrun's own parser, scripts of the
repository exist, are executable and pass `bash -n`, the variables set before them are ones
they read, and the options given to a Python script are ones it defines. The few cheap
commands in RUN also run, as written, in a temporary folder. A command of a kind no check
knows fails, unless its block is marked `<!-- not checked: REASON -->` on the line before.

Relative links and their #anchors, repository paths named in `code` spans, and the files of
docs/design.md's layout must exist (and every module be in it); python blocks must compile;
the README's options table lists exactly the options of `hvd-cpu train`.
"""

from __future__ import annotations

import ast
import contextlib
import fnmatch
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PAGES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
SHELL = ("bash", "sh", "console")
OTHER_BLOCKS = ("python", "")  # python is compiled; unlabelled blocks are output, not commands
CONFIG_BLOCKS = ("toml", "yaml")  # --config files: read by `hvd-cpu train --config`
NOT_CHECKED = re.compile(r"<!--\s*not checked:\s*(\S.*?)\s*-->")
MAX_NOT_CHECKED = 3

# Run as written, in this order, in one temporary folder: each must appear in the README.
RUN = (
    "hvd-cpu --help",
    "hvd-cpu make-demo-data frame.parquet --rows 20000 --features 16",
    "hvd-cpu train --data frame.parquet --epochs 2 --output runs/one",
    "hvd-cpu plot runs/one",
)
RUN_TIMEOUT = 120

# Commands that do nothing a page could get wrong.
HARMLESS = {"cd", "echo", "printf", "sleep"}
# A repository script's arguments: what its "$@" becomes.
SCRIPT_ARGS = {
    "launch/demo.sh": "train",
    "launch/elastic.sh": "train",
    "launch/slurm.sbatch": "train",
    "launch/run-hosts.sh": "hostfile train",
    "launch/test.sh": "pytest",
    "launch/test-container.sh": "none",
}
# The options of launchers whose own parser is not at hand, each with whether it takes a value.
MPIRUN_OPTIONS = {"-np": True}
SBATCH_OPTIONS = {"--ntasks": True, "--cpus-per-task": True, "--wait": False}
DOCKER_OPTIONS = {
    "build": {"-t": True},
    "run": {
        "--rm": False,
        "-d": False,
        "--name": True,
        "--network": True,
        "-e": True,
        "-v": True,
        "--cpus": True,
        "--user": True,
        "--shm-size": True,
    },
    "exec": {},
}
IMAGE = "hvd-cpu"  # the tag the pages build the image with
PLACEHOLDER = "..."  # "the rest as above": the words before it are checked, not after
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<"}


class Problem(Exception):
    """What is wrong with a command, in one line."""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence
    lang: str
    body: tuple[str, ...]
    not_checked: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


@dataclass(frozen=True)
class Command:
    where: str
    text: str  # as written: its lines, comments and all
    words: tuple[str, ...]
    not_checked: str | None


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if fence:
            start, body = i, []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"{page.name}:{start + 1}: a fence that never closes"
            before = next((x for x in reversed(lines[:start]) if x.strip()), "")
            marker = NOT_CHECKED.search(before)
            found.append(
                Block(page, start + 1, fence[1], tuple(body), marker[1] if marker else None)
            )
        i += 1
    return found


def prose(page: Path) -> str:
    """A page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def words_of(text: str) -> list[str]:
    """Shell words, with comments dropped and backslash-newlines joined."""
    lexer = shlex.shlex(text.replace("\\\n", " "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """(first line number, text) of each command, across continuation lines and quotes."""
    pending: list[str] = []
    first = 0
    for number, line in lines:
        if not pending:
            first = number
        pending.append(line)
        text = "\n".join(pending)
        if text.rstrip().endswith("\\"):
            continue
        try:
            words = words_of(text)
        except ValueError:  # an open quote: the command goes on
            continue
        if words and words[-1] in SEPARATORS - {";"}:
            continue
        pending = []
        if words:
            yield first, text
    assert not pending, f"line {first}: a command that never ends"


def commands_of(block: Block) -> list[Command]:
    numbered = list(enumerate(block.body, block.line + 1))
    if block.lang == "console":  # "$ command" lines, each with its continuation lines
        kept, going_on = [], False
        for number, line in numbered:
            if line.startswith("$ ") or going_on:
                kept.append((number, line.removeprefix("$ ")))
                going_on = line.rstrip().endswith("\\")
        numbered = kept
    return [
        Command(
            f"{block.page.relative_to(REPO)}:{number}",
            text,
            tuple(words_of(text)),
            block.not_checked,
        )
        for number, text in logical_lines(numbered)
    ]


@cache
def all_blocks() -> tuple[Block, ...]:
    return tuple(block for page in PAGES for block in blocks(page))


@cache
def all_commands() -> tuple[Command, ...]:
    return tuple(
        command for block in all_blocks() if block.lang in SHELL for command in commands_of(block)
    )


def simple_commands(words: tuple[str, ...] | list[str]) -> Iterator[list[str]]:
    """The simple commands of a line (split at && ; | ...), redirections dropped."""
    current: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in SEPARATORS:
            if current:
                yield current
            current = []
        elif word in REDIRECTS:
            skip = True
        else:
            current.append(word)
    if current:
        yield current


# Checks, one per kind of command. Each raises Problem.


def check_line(words: list[str] | tuple[str, ...]) -> None:
    for simple in simple_commands(words):
        check_simple(simple)


def check_simple(words: list[str]) -> None:
    env = {}
    while words and re.match(r"^[A-Za-z_]\w*=", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    if not words:
        return
    program, args = words[0], words[1:]
    if PLACEHOLDER in args:
        args = args[: args.index(PLACEHOLDER)]
    if env and not program.startswith(("./", "launch/")):
        raise Problem(f"variables set for {program}, which no check knows: {sorted(env)}")
    if program == "hvd-cpu":
        check_hvd_cpu(args)
    elif program == "horovodrun":
        check_horovodrun(args)
    elif program == "mpirun":
        check_command_after(args, MPIRUN_OPTIONS, "mpirun")
    elif program == "sbatch":
        script, rest = split_options(args, SBATCH_OPTIONS, "sbatch")
        check_script(script, rest, env={}, direct=False)
    elif program == "docker":
        check_docker(args)
    elif program in ("python", ".venv/bin/python"):
        if program != "python":
            check_venv_path(program)
        check_python(args)
    elif program == ".venv/bin/pip":
        check_pip(args)
    elif program == "source":
        check_venv_path(args[0])
    elif program == "cp":
        if not (REPO / args[0]).exists():
            raise Problem(f"cp: {args[0]} is not in the repository")
    elif program == "sh" and args[:1] == ["-c"]:
        check_line(tuple(words_of(args[1])))
    elif program in HARMLESS:
        pass
    elif program.removeprefix("./") in SCRIPT_ARGS:
        check_script([program], args, env, direct=True)
    else:
        raise Problem(f"no check knows the command {program!r}")


@contextlib.contextmanager
def paths_need_not_exist(command: click.Command) -> Iterator[None]:
    """Parse paths the user will have (a training's output) without asking for them here, nor
    reading the files that eager options read (--config: test_config_blocks_parse checks the
    pages' config files)."""
    paths = [p.type for p in command.params if isinstance(p.type, click.Path) and p.type.exists]
    readers = {
        p: p.callback for p in command.params if p.is_eager and isinstance(p.type, click.Path)
    }
    for path in paths:
        path.exists = False
    for reader in readers:
        reader.callback = None
    try:
        yield
    finally:
        for path in paths:
            path.exists = True
        for reader, callback in readers.items():
            reader.callback = callback


def check_hvd_cpu(args: list[str]) -> None:
    from hvd_cpu.cli import cli

    if not args or args[0].startswith("-"):
        if set(args) - {"--help", "-h", "--version"}:
            raise Problem(f"hvd-cpu takes no options before its command: {args}")
        return
    command = cli.get_command(click.Context(cli), args[0])
    if command is None:
        raise Problem(f"hvd-cpu has no command {args[0]!r} (it has {sorted(cli.commands)})")
    check_click(command, f"hvd-cpu {args[0]}", args[1:])


def check_click(command: click.Command, name: str, args: list[str]) -> None:
    with paths_need_not_exist(command), contextlib.redirect_stdout(io.StringIO()):
        try:
            command.make_context(name, list(args), resilient_parsing=False)
        except click.exceptions.Exit:
            if "--help" not in args:
                raise Problem(f"{name} {args}: exits without doing anything") from None
        except click.ClickException as exc:
            raise Problem(f"{name}: {exc.format_message()}") from None


def check_train_args(args: list[str]) -> None:
    from hvd_cpu.cli import cli

    check_click(cli.commands["train"], "hvd-cpu train", args)


def check_horovodrun(args: list[str]) -> None:
    from horovod.runner import launch

    argv, err = sys.argv, io.StringIO()
    sys.argv = ["horovodrun", *args]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed = launch.parse_args()
    except SystemExit:
        raise Problem(err.getvalue().strip().splitlines()[-1]) from None
    finally:
        sys.argv = argv
    if not parsed.command:
        raise Problem("horovodrun: no command to run")
    check_simple(list(parsed.command))


def split_options(args: list[str], known: dict[str, bool], who: str) -> tuple[list, list]:
    """A launcher's own options, then the rest of its arguments."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        name, has_value, _ = args[i].partition("=")
        if name not in known:
            raise Problem(f"{who}: option {name} is not one this check knows")
        i += 1 if has_value or not known[name] else 2
    return args[i : i + 1], args[i + 1 :]


def check_command_after(args: list[str], known: dict[str, bool], who: str) -> None:
    program, rest = split_options(args, known, who)
    if not program:
        raise Problem(f"{who}: no command to run")
    check_simple(program + rest)


def check_docker(args: list[str]) -> None:
    verb, rest = args[0], args[1:]
    if verb not in DOCKER_OPTIONS:
        raise Problem(f"docker {verb}: no check knows it")
    target, command = split_options(rest, DOCKER_OPTIONS[verb], f"docker {verb}")
    if verb == "build":
        if not (REPO / target[0] / "Dockerfile").is_file():
            raise Problem(f"docker build {target[0]}: no Dockerfile there (run from the repo)")
    elif verb == "run":
        if target != [IMAGE]:
            raise Problem(f"docker run: image {target} is not the one the pages build, {IMAGE}")
        check_simple(command or dockerfile_cmd())
    else:  # exec CONTAINER COMMAND
        check_simple(command)


def dockerfile_cmd() -> list[str]:
    line = next(x for x in (REPO / "Dockerfile").read_text().splitlines() if x.startswith("CMD"))
    return json.loads(line.removeprefix("CMD"))


def check_venv_path(path: str) -> None:
    if not path.startswith(".venv/bin/") or not (BIN / Path(path).name).exists():
        raise Problem(f"{path} is not in the virtual environment install.sh makes")


def check_pip(args: list[str]) -> None:
    check_venv_path(".venv/bin/pip")
    if args[:1] != ["install"]:
        raise Problem(f"pip {args[:1]}: only pip install is checked")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    declared = [*project["dependencies"], *(spec for extra in extras for spec in extra)]
    names = {re.split(r"[<>=!~\[ ]", spec, maxsplit=1)[0].lower() for spec in declared}
    for package in args[1:]:
        if package.lower() not in names:
            raise Problem(f"pip install {package}: not a dependency declared in pyproject.toml")


def check_python(args: list[str]) -> None:
    if args[:1] == ["-c"]:
        check_python_code(args[1])
        return
    script = REPO / args[0]
    if script.suffix != ".py" or not script.is_file():
        raise Problem(f"python {args[0]}: no such script in the repository")
    tree = ast.parse(script.read_text(), str(script))
    options = {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", "") == "add_argument"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }
    given = args[1:]
    if options:
        unknown = [w.partition("=")[0] for w in given if w.startswith("-")]
        unknown = [w for w in unknown if w not in options]
        if unknown:
            raise Problem(f"{args[0]} defines no {unknown} (it has {sorted(options)})")
        return
    usage = [line.split() for line in (ast.get_docstring(tree) or "").splitlines()]
    usage = [line for line in usage if args[0] in line]
    if not usage:
        raise Problem(f"{args[0]}: no argparse and no usage line in its docstring to check")
    expected = usage[0][usage[0].index(args[0]) + 1 :]
    if len(given) != len(expected):
        raise Problem(f"{args[0]} takes {expected}, given {given}")


def check_python_code(code: str) -> None:
    """Compiles, and what it imports from hvd-cpu is there."""
    import importlib
    import importlib.util

    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise Problem(f"python -c: {exc}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            if missing:
                raise Problem(f"python -c: {node.module} has no {missing}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if importlib.util.find_spec(alias.name) is None:
                    raise Problem(f"python -c: no module {alias.name}")


def script_problems(path: Path) -> str | None:
    """Why a shell script of the repository would not run, or None."""
    if not path.is_file():
        return f"{path.relative_to(REPO)} does not exist"
    checked = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    if checked.returncode:
        return f"bash -n {path.relative_to(REPO)}: {checked.stderr.strip()}"
    return None


def check_script(words: list[str], args: list[str], env: dict[str, str], direct: bool) -> None:
    if not words:
        raise Problem("no script given")
    name = words[0].removeprefix("./")
    path = REPO / name
    if name not in SCRIPT_ARGS:
        raise Problem(f"{name}: not a script whose arguments this check knows")
    problem = script_problems(path)
    if problem:
        raise Problem(problem)
    if direct and not os.access(path, os.X_OK):
        raise Problem(f"{name} is run directly but is not executable")
    text = path.read_text()
    unread = [v for v in env if not re.search(rf"\${{?{v}\b", text)]
    if unread:
        raise Problem(f"{name} does not read {unread}")
    kind = SCRIPT_ARGS[name]
    if kind == "none" and args:
        raise Problem(f"{name} takes no arguments, given {args}")
    if kind == "pytest":
        missing = [a for a in args if not a.startswith("-") and not (REPO / a).exists()]
        if missing:
            raise Problem(f"{name}: no test path {missing}")
    if kind == "hostfile train":
        if not args:
            raise Problem(f"{name} needs a host file first")
        args = args[1:]
    if kind.endswith("train"):
        check_train_args(args)


# The tests.


def test_pages_have_commands() -> None:
    """The extraction finds what it should: a change to the fences shows up here."""
    commands = all_commands()
    assert len(commands) >= 40, [c.text for c in commands]
    # CI runs the README's test command: it stays there, as it is.
    assert "bash launch/test.sh" in (REPO / ".ci/run").read_text()
    assert any(c.words == ("./launch/test.sh",) for c in commands if "README" in c.where)


def test_every_block_is_a_known_kind() -> None:
    """A command in a block of another kind would be neither checked nor skipped."""
    wrong = [
        f"{b.where}: ```{b.lang}"
        for b in all_blocks()
        if b.lang not in (*SHELL, *OTHER_BLOCKS, *CONFIG_BLOCKS)
    ]
    prompts = [
        f"{b.where}: a '$ ' line in a block that is not ```console"
        for b in all_blocks()
        if b.lang != "console" and any(line.startswith("$ ") for line in b.body)
    ]
    assert not wrong + prompts


def test_few_blocks_are_not_checked() -> None:
    marked = [b.where for b in all_blocks() if b.not_checked]
    assert len(marked) <= MAX_NOT_CHECKED, marked


@pytest.mark.parametrize("command", all_commands(), ids=lambda c: c.where)
def test_command_is_valid(
    command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if command.not_checked:
        pytest.skip(f"marked not checked: {command.not_checked}")
    monkeypatch.chdir(tmp_path)  # paths the command names are the user's, not this folder's
    try:
        check_line(command.words)
    except Problem as exc:
        pytest.fail(f"{command.where}: {command.text.strip()}\n  {exc}", pytrace=False)


def normalised(text: str) -> str:
    return " ".join(words_of(text))


def test_cheap_commands_run_as_written(tmp_path: Path) -> None:
    readme = {normalised(c.text): c.text for c in all_commands() if c.where.startswith("README")}
    missing = [run for run in map(normalised, RUN) if run not in readme]
    assert not missing, f"RUN names commands the README no longer has: {missing}"
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    outputs = []
    for run in RUN:
        done = subprocess.run(
            ["bash", "-c", readme[normalised(run)]],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
        )
        assert done.returncode == 0, f"{run}\n{done.stdout}\n{done.stderr}"
        outputs.append(done.stdout)
    assert all(name in outputs[0] for name in ("train", "predict", "make-demo-data"))
    assert "wrote 20000 rows" in outputs[1]
    epochs = (tmp_path / "runs/one/metrics.jsonl").read_text().splitlines()
    assert len(epochs) == 2
    assert (tmp_path / "runs/one/model.pt").is_file()
    assert (tmp_path / "runs/one/loss.png").is_file()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", prose(page), flags=re.M):
        base = anchor = slug(heading)
        n = 0
        while anchor in found:
            n += 1
            anchor = f"{base}-{n}"
        found.add(anchor)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(page)):
        if re.match(r"^[a-z]+://", target):
            continue  # the web is not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_relative_to(REPO) or not file.exists():
            broken.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: {file.name} has no heading #{anchor}")
    assert not broken, broken


REPO_PATH = re.compile(r"^(?:\./)?(?:launch|benchmarks|tests|hvd_cpu|docs|\.ci)/\S*$")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_paths_named_in_the_text_exist(page: Path) -> None:
    missing, scripts = [], []
    for span in re.findall(r"`([^`]+)`", prose(page)):
        for word in span.split():
            word = word.rstrip(".,;:)")
            if not REPO_PATH.match(word):
                continue
            word = word.removeprefix("./")
            matches = list(REPO.glob(word)) if "*" in word else [REPO / word]
            matches = [m for m in matches if m.exists()]
            if not matches:
                missing.append(word)
            scripts += [m for m in matches if m.suffix in (".sh", ".sbatch")]
    assert not missing, missing
    broken = [problem for problem in map(script_problems, scripts) if problem]
    assert not broken, broken


@pytest.mark.parametrize(
    "block", [b for b in all_blocks() if b.lang == "python"], ids=lambda b: b.where
)
def test_python_blocks_compile(block: Block) -> None:
    compile("\n".join(block.body), block.where, "exec")


@pytest.mark.parametrize(
    "block", [b for b in all_blocks() if b.lang in CONFIG_BLOCKS], ids=lambda b: b.where
)
def test_config_blocks_parse(block: Block, tmp_path: Path) -> None:
    """A page's config file gives `hvd-cpu train` options it has, with values it takes."""
    from hvd_cpu.cli import cli

    config = tmp_path / f"run.{block.lang}"
    config.write_text("\n".join(block.body) + "\n")
    train = cli.commands["train"]
    try:
        train.make_context("hvd-cpu train", ["--config", str(config)])
    except click.ClickException as exc:
        pytest.fail(exc.format_message())


def layout() -> list[str]:
    """The files docs/design.md's layout names, as paths (or patterns) in the repository."""
    page = REPO / "docs/design.md"
    block = next(b for b in blocks(page) if "hvd_cpu/" in "".join(b.body[:1]))
    named, folder = [], ""
    for line in block.body:
        label = re.match(r"^([\w.]+/)\s", line)
        if label:
            folder = label[1]
        for name in re.findall(
            r"[\w.*-]+(?:/[\w.*-]+)*\.(?:py|ipynb|sh|sbatch|example|md|patch)\b", line
        ):
            named.append(folder + name)
    return named


def test_layout_names_the_files_there_are() -> None:
    named = layout()
    missing = [name for name in named if not list(REPO.glob(name))]
    assert not missing, f"docs/design.md's layout names files that are not there: {missing}"
    there = [
        *(REPO / "hvd_cpu").rglob("*.py"),
        *(REPO / "launch").iterdir(),
        *(REPO / "benchmarks").glob("*.py"),
        *(REPO / "docs").glob("*.md"),
        *(REPO / "examples").iterdir(),
    ]
    unnamed = [
        str(path.relative_to(REPO))
        for path in there
        if path.name != "__init__.py"
        and path.is_file()
        and not any(fnmatch.fnmatch(str(path.relative_to(REPO)), name) for name in named)
    ]
    assert not unnamed, f"docs/design.md's layout does not name: {unnamed}"


@pytest.mark.parametrize(
    "room", sorted(p.parent.name for p in (REPO / "hvd_cpu").glob("*/__init__.py")), ids=str
)
def test_each_room_says_what_is_in_it(room: str) -> None:
    """The tree is the map: each folder of hvd_cpu/ says in its __init__ docstring what every
    module there is for, and every module says why it exists."""
    folder = REPO / "hvd_cpu" / room
    said = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    modules = sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")
    unnamed = [name for name in modules if name not in said]
    assert not unnamed, f"hvd_cpu/{room}/__init__.py does not say what {unnamed} are for"
    undocumented = [
        name for name in modules if not ast.get_docstring(ast.parse((folder / name).read_text()))
    ]
    assert not undocumented, f"modules in hvd_cpu/{room} without a docstring: {undocumented}"


def test_options_table_is_train_s_options() -> None:
    """The README's options table lists every option of `hvd-cpu train`, and no other."""
    from hvd_cpu.cli import cli

    readme = (REPO / "README.md").read_text()
    table = readme.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    listed = {
        name
        for row in re.findall(r"^\| `([^`]+)`", table, flags=re.M)
        for name in re.findall(r"--[\w-]+", row)
    }
    train = cli.commands["train"]
    real = {
        name
        for param in train.get_params(click.Context(train))
        if isinstance(param, click.Option)
        for name in [*param.opts, *param.secondary_opts]
        if name.startswith("--") and name != "--help"
    }
    assert listed == real, {"not in the table": real - listed, "not options": listed - real}
