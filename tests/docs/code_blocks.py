"""The documentation's code blocks: found in Markdown, checked, and run page by page (docs/code-blocks.md).

Why a runner of our own rather than pytest-examples, sybil or mktestdocs: a tutorial is a sequence of shell
commands and Python snippets that build on each other's files (shards built in one block, trained on in the
next), with config files shown as titled blocks; the runner has to interleave the two languages in page order in
one folder, write titled blocks to disk, honour a marker that says why a block cannot run here, and compare
a page's claims about output with what the block before them printed (tests/docs/expected_output.py). That is
about two hundred lines; the libraries each cover part of it. The folder a page runs in is a copy of the whole
repository, as a reader's clone is (tests/docs/page_tree.py); the `ddp-rank` commands run forked from warm
servers (tests/docs/warm_commands.py).

Only the standard library (and the Results hook, docs/hooks/results.py, which names the result files the site
shows): the tests import it, and so can a contributor's script.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from docs.hooks.results import rendered_files
from tests.docs.expected_output import match_output
from tests.docs.page_tree import copy_repository, stray_report, stray_writes
from tests.docs.warm_commands import WarmCommand, kill_group, warm_set

BASH = frozenset({"bash", "sh", "shell"})
PYTHON = frozenset({"python", "py", "python3"})
# Languages shown as data: output, files, diagrams. Any other language (```console, ```pycon, ```zsh, ...) looks
# like something a reader runs, yet the runner would neither run it nor fail it: the fence check refuses it.
DATA = frozenset({"text", "yaml", "yml", "json", "toml", "ini", "csv", "mermaid", "markdown", "md", "diff"})
BLOCK_TIMEOUT_S = 180.0
PYTHON_SESSION = Path(__file__).with_name("python_session.py")

_FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>.*)$")
# ```bash, ```py title="x.py", ``` { .python title="x.py" } (superfences' attribute form)
_LANG = re.compile(r"^\{?\s*\.?([\w+-]+)")
_TITLE = re.compile(r"""title=(?:"([^"]*)"|'([^']*)')""")
_MARKER = re.compile(r"^\s*<!--\s*not[- _]?run\b(?P<rest>.*?)-->\s*$", re.IGNORECASE)
_ANY_MARKER = re.compile(r"^\s*<!--\s*not[- _]?run\b", re.IGNORECASE)
# <!-- expected-output --> before a ```text block: the output the block before it must print.
_EXPECT = re.compile(r"^\s*<!--\s*expected-output(?P<order>:\s*any order)?\s*-->\s*$")
_ANY_EXPECT = re.compile(r"^\s*<!--\s*expected[- _]?output\b", re.IGNORECASE)


@dataclass(frozen=True)
class Block:
    """One fenced block of a page. ``line`` is the 1-based line of its opening fence."""

    page: str
    line: int
    lang: str
    title: str | None
    code: str
    marker: str | None = None  # the not-run reason ("" for a marker without one); None: no marker
    expects: bool = False  # after <!-- expected-output -->: what the block before it prints
    any_order: bool = False  # <!-- expected-output: any order -->

    @property
    def runs(self) -> bool:
        """Whether the suite runs this block (bash or python, no title, no marker)."""
        return self.title is None and self.marker is None and self.lang in BASH | PYTHON

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def parse(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a Markdown page, and the problems of its fences and markers (each a one-line
    message naming ``page:line``): a fence without a language, an unclosed fence, a not-run marker without
    its reason, on a block that would not run anyway, or on no block, a language neither run nor data, a title
    that leaves the page's folder, a titled file no later block names."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    markers_used: set[int] = set()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        start, indent, fence = i, len(match["indent"]), match["fence"]
        info = match["info"].strip()
        closing = re.compile(rf"^[ ]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        i += 1
        body = []
        while i < len(lines) and not closing.match(lines[i]):
            body.append(_dedent(lines[i], indent))
            i += 1
        if i == len(lines):
            problems.append(f"{page}:{start + 1}: the fence opened here is never closed")
        i += 1
        lang_match = _LANG.match(info)
        lang = lang_match[1].lower() if lang_match else ""
        title_match = _TITLE.search(info)
        title = next((g for g in title_match.groups() if g is not None), None) if title_match else None
        marker, marker_line = _marker_before(lines, start)
        expect_line, any_order = _expect_before(lines, start)
        code = "\n".join(body) + "\n" if body else ""
        block = Block(page, start + 1, lang, title, code, marker, expect_line is not None, any_order)
        blocks.append(block)
        markers_used.update(n for n in (marker_line, expect_line) if n is not None)
        problems += _problems(block)
    problems += _unused_files(blocks) + _expectations_without_output(blocks)
    for n, line in enumerate(lines):
        if n in markers_used or _inside_block(n, blocks, lines):
            continue
        if _ANY_MARKER.search(line):
            problems.append(
                f"{page}:{n + 1}: a not-run marker must be the last non-blank line before a fence, alone on its "
                f"line, as <!-- not-run: the reason -->"
            )
        elif _ANY_EXPECT.search(line):
            problems.append(
                f"{page}:{n + 1}: an expected-output marker must be the last non-blank line before a ```text "
                f"fence, alone on its line, as <!-- expected-output --> or <!-- expected-output: any order -->"
            )
    return blocks, problems


def _dedent(line: str, indent: int) -> str:
    stripped = len(line) - len(line.lstrip(" "))
    return line[min(indent, stripped) :]


def _marker_before(lines: list[str], fence: int) -> tuple[str | None, int | None]:
    n = fence - 1
    while n >= 0 and not lines[n].strip():
        n -= 1
    match = _MARKER.match(lines[n]) if n >= 0 else None
    if not match:
        return None, None
    rest = match["rest"].strip()
    return (rest[1:].strip() if rest.startswith(":") else ""), n


def _expect_before(lines: list[str], fence: int) -> tuple[int | None, bool]:
    n = fence - 1
    while n >= 0 and not lines[n].strip():
        n -= 1
    match = _EXPECT.match(lines[n]) if n >= 0 else None
    return (n, match["order"] is not None) if match else (None, False)


def _expectations_without_output(blocks: list[Block]) -> list[str]:
    """An expected-output block checks the block right before it, which must be one the suite runs."""
    out = []
    for before, block in zip([None, *blocks], blocks, strict=False):
        if block.expects and (before is None or not before.runs):
            what = "no block" if before is None else f"the block at {before.where}, which does not run"
            out.append(
                f"{block.where}: an expected-output block checks the output of the block right before it, here "
                f"{what}; put it after the ```bash or ```python block whose output it shows, or drop the marker"
            )
    return out


def _inside_block(n: int, blocks: list[Block], lines: list[str]) -> bool:
    """Whether line ``n`` (0-based) lies inside a fenced block (a page may show the marker as an example)."""
    for block in blocks:
        first = block.line  # 0-based index of the first body line
        if first <= n < first + block.code.count("\n"):
            return True
    return False


def _problems(block: Block) -> list[str]:
    out = []
    if not block.lang:
        out.append(f"{block.where}: a fence without a language; name it (```text for output or plain text)")
    elif block.title is None and block.lang not in BASH | PYTHON | DATA:  # a titled block is a file
        out.append(
            f"{block.where}: ```{block.lang} is neither run (```bash, ```python) nor data "
            f"({', '.join(sorted(DATA))}); write the commands as ```bash or ```python, output as ```text"
        )
    if block.marker is not None:
        if not block.marker:
            out.append(
                f"{block.where}: the not-run marker gives no reason; write <!-- not-run: the reason -->"
            )
        if block.title is not None or block.lang not in BASH | PYTHON:
            out.append(
                f"{block.where}: a not-run marker on a block that is not run anyway ({block.lang or 'no language'}"
                f"{', titled' if block.title is not None else ''}); remove the marker"
            )
    if block.expects and (block.lang != "text" or block.title is not None):
        out.append(
            f"{block.where}: <!-- expected-output --> goes before an untitled ```text block (the output), not a "
            f"```{block.lang or 'block without a language'}{' with a title' if block.title is not None else ''}"
        )
    elif block.expects and not block.code.strip():
        out.append(f"{block.where}: the expected-output block is empty; show the lines the command prints")
    if block.title is not None:
        path = Path(block.title)
        if not block.title or path.is_absolute() or ".." in path.parts:
            out.append(
                f"{block.where}: title={block.title!r} must be a relative path inside the page's folder"
            )
    return out


def _unused_files(blocks: list[Block]) -> list[str]:
    """A titled block is a file the page's later blocks use; one that no later block names (by its path or its
    file name) is data shown under a title, and belongs in an untitled data block."""
    out = []
    for i, block in enumerate(blocks):
        if block.title is None or not block.title:
            continue
        names = {block.title, Path(block.title).name}
        if not any(name in later.code for later in blocks[i + 1 :] for name in names):
            out.append(
                f"{block.where}: title={block.title!r} writes a file that no later block uses; drop the title "
                f"(or use the file below it)"
            )
    return out


def doc_pages(repo: Path) -> list[Path]:
    """README.md, ARCHITECTURE.md (the site includes it), every Markdown page under docs/ (the build hooks'
    folder excluded), the READMEs under benchmarks/ and the result files of benchmarks/results/ that the site
    renders (docs/hooks/results.py chooses them)."""
    pages = [repo / name for name in ("README.md", "ARCHITECTURE.md") if (repo / name).exists()]
    if (repo / "benchmarks").is_dir():
        pages += sorted((repo / "benchmarks").rglob("README.md"))
    if (repo / "benchmarks" / "results").is_dir():
        pages += rendered_files(repo / "benchmarks" / "results")
    pages += sorted(
        p for p in (repo / "docs").rglob("*.md") if "hooks" not in p.relative_to(repo / "docs").parts
    )
    return pages


# ---------------------------------------------------------------------------------------------------------------
# Running a page
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    block: Block
    status: str  # "ran", "written", "not run" (marked), "data", "matched" (expected output), "failed"
    output: str = ""
    seconds: float = 0.0


@dataclass
class PageRun:
    page: str
    outcomes: list[Outcome] = field(default_factory=list)
    # What the blocks left outside the ignored folders of the copy (page_tree.stray_writes), once all ran.
    stray: list[str] = field(default_factory=list)

    @property
    def failure(self) -> Outcome | None:
        return next((o for o in self.outcomes if o.status == "failed"), None)

    @property
    def ok(self) -> bool:
        """Every block ran, every expected output matched, and nothing was written outside ignored folders."""
        return self.failure is None and not self.stray

    def report(self, tail_lines: int = 40) -> str:
        failed = self.failure
        if failed is None:
            return stray_report(self.page, self.stray) if self.stray else f"{self.page}: every block ran"
        output = "\n".join(failed.output.rstrip().splitlines()[-tail_lines:])
        if failed.block.expects:
            return (
                f"{failed.block.where}: the expected output does not match what the block before it printed: "
                f"{failed.output.splitlines()[0]}\n{failed.block.code}\n--- the block's output (last {tail_lines} "
                f"lines) ---\n" + "\n".join(failed.output.rstrip().splitlines()[1:][-tail_lines:])
            )
        return (
            f"{failed.block.where}: this ```{failed.block.lang} block failed (mark it <!-- not-run: the reason --> "
            f"if it cannot run in the suite):\n{failed.block.code}\n--- its output (last {tail_lines} lines) ---\n"
            f"{output}"
        )


def prepare_folder(folder: Path, repo: Path) -> dict[str, tuple[int, int]]:
    """A page's folder as the root of a clone looks to a reader: a copy of the repository's files
    (tests/docs/page_tree.py); returns what :func:`page_tree.stray_writes` compares the folder with afterwards."""
    return copy_repository(repo, folder)


def block_env(repo: Path, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a page's blocks: the venv's bin first on PATH, this checkout's ``ddp_rank`` importable,
    ``DDP_RANK_REPO`` the repository root."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    env["DDP_RANK_REPO"] = str(repo)
    env.setdefault("MPLBACKEND", "Agg")
    return env


def run_page(
    page: Path,
    repo: Path,
    folder: Path,
    *,
    env: dict[str, str] | None = None,
    timeout: float = BLOCK_TIMEOUT_S,
    warm: Sequence[WarmCommand] = (),
) -> PageRun:
    """Run the blocks of ``page`` in order in ``folder`` (empty; prepared here), stopping at the first failure.
    The commands of ``warm`` that a bash block names run forked from a warm server (:class:`WarmCommand`)."""
    name = page.relative_to(repo).as_posix() if page.is_relative_to(repo) else page.name
    blocks, problems = parse(page.read_text(encoding="utf-8"), name)
    if problems:
        raise ValueError("\n".join(problems))
    copied = prepare_folder(folder, repo)
    run = PageRun(name)
    env = block_env(repo, env)
    named = [
        command
        for command in warm
        if any(block.runs and block.lang in BASH and command.named_in(block.code) for block in blocks)
    ]
    if named and os.environ.get("DOCS_WARM", "1") != "0":
        env = warm_set(tuple(named), env).page_env
    with (
        tempfile.TemporaryDirectory(prefix="docs-state-") as state,
        _PythonSession(folder, env, Path(state)) as py,
    ):
        shell = _Shell(folder, env, Path(state))
        for block in blocks:
            started = time.monotonic()
            if block.title is not None:
                target = folder / block.title
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(block.code, encoding="utf-8")
                run.outcomes.append(Outcome(block, "written"))
                continue
            if block.marker is not None:
                run.outcomes.append(Outcome(block, "not run"))
                continue
            if block.expects:  # parse() made sure the outcome before it is of a block that ran
                mismatch = match_output(block.code, run.outcomes[-1].output, any_order=block.any_order)
                if mismatch is None:
                    run.outcomes.append(Outcome(block, "matched"))
                    continue
                output = mismatch.describe() + "\n" + run.outcomes[-1].output
                run.outcomes.append(Outcome(block, "failed", output))
                break
            if not block.runs:
                run.outcomes.append(Outcome(block, "data"))
                continue
            ok, output = shell.run(block, timeout) if block.lang in BASH else py.run(block, timeout)
            run.outcomes.append(Outcome(block, "ran" if ok else "failed", output, time.monotonic() - started))
            if not ok:
                break
    if run.failure is None:
        run.stray = stray_writes(folder, copied)
    return run


class _Shell:
    """The page's bash blocks, each in its own ``bash -euo pipefail`` with ``inherit_errexit`` (a failing
    command inside ``$(...)`` fails the block too, bash >= 4.4); the exported variables and the working directory
    a block ends with are where the next one starts (as in one terminal)."""

    def __init__(self, folder: Path, env: dict[str, str], state: Path) -> None:
        self.env, self.state = env, state
        (state / "cwd").write_text(str(folder))

    def run(self, block: Block, timeout: float) -> tuple[bool, str]:
        exports, cwd, script = self.state / "exports", self.state / "cwd", self.state / "block.sh"
        script.write_text(
            "shopt -s inherit_errexit\n"
            f'if [ -f "{exports}" ]; then . "{exports}"; fi\n'
            f'cd "$(cat "{cwd}")"\n'
            f'trap \'__status=$?; export -p > "{exports}.new"; pwd > "{cwd}.new"; exit $__status\' EXIT\n'
            + "\n" * max(0, block.line - 4)  # bash's error lines then name the page's lines
            + block.code
        )
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", str(script)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return False, f"timed out after {timeout:g} s"
        if proc.returncode == 0:
            for path in (exports, cwd):
                Path(f"{path}.new").replace(path)
            return True, output
        return False, output + f"\n(exit status {proc.returncode})"


class _PythonSession:
    """The page's python blocks in one namespace: a child process (tests/docs/python_session.py) that runs each
    block it is sent and answers on its own pipe, so a block's output and a hung block cannot confuse the runner.
    Started on the first python block."""

    def __init__(self, folder: Path, env: dict[str, str], state: Path) -> None:
        self.folder, self.env, self.state = folder, env, state
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> _PythonSession:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            kill_group(self.proc)

    def run(self, block: Block, timeout: float) -> tuple[bool, str]:
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, str(PYTHON_SESSION)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=(self.state / "session.err").open("w"),
                cwd=self.folder,
                env=self.env,
                text=True,
                start_new_session=True,
            )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        log = self.state / "python.log"
        request = {"code": "\n" * block.line + block.code, "name": block.where, "log": str(log)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            ready = selector.select(timeout)
        output = log.read_text(errors="replace") if log.exists() else ""
        if not ready:
            kill_group(self.proc)
            self.proc = None
            return False, output + f"\ntimed out after {timeout:g} s"
        line = self.proc.stdout.readline()
        if not line:
            errors = (self.state / "session.err").read_text(errors="replace")
            return False, output + "\nthe Python session ended:\n" + errors
        reply = json.loads(line)
        return bool(reply["ok"]), output + reply["error"]
