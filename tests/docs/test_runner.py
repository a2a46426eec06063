"""The code-block runner itself (tests/docs/code_blocks.py), on small synthetic pages: what it parses, what it
refuses, what it runs and how a page's blocks share (or do not share) their folder, variables and namespace."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.docs.code_blocks import WarmCommand, parse, run_page

FENCE = "```"


def page(tmp_path: Path, text: str, name: str = "page.md") -> tuple[Path, Path]:
    """A repository with one page (and a configs/ folder the runner copies) -> (repo, page)."""
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True, exist_ok=True)
    (repo / "configs" / "demo.yaml").write_text("train:\n  steps: 2\n")
    path = repo / name
    path.write_text(text)
    return repo, path


def run(tmp_path: Path, text: str, name: str = "page.md", timeout: float = 30):
    repo, path = page(tmp_path, text, name)
    folder = tmp_path / f"run-{name}"
    folder.mkdir()
    return run_page(path, repo, folder, timeout=timeout), folder


def test_parse_languages_titles_markers_and_indented_fences() -> None:
    text = f"""# T

{FENCE}bash
echo hi
{FENCE}

<!-- not-run: needs a GPU -->

{FENCE}python
import torch
{FENCE}

{FENCE}yaml title="configs/tiny.yaml"
a: 1
{FENCE}

!!! note
    {FENCE}sh
    ls
    {FENCE}

{FENCE}text
output
{FENCE}

~~~ {{ .python title="train.py" }}
print(1)
~~~

{FENCE}bash
python train.py && cat configs/tiny.yaml
{FENCE}
"""
    blocks, problems = parse(text, "p.md")
    assert problems == []
    assert [(b.lang, b.title, b.marker, b.runs) for b in blocks] == [
        ("bash", None, None, True),
        ("python", None, "needs a GPU", False),
        ("yaml", "configs/tiny.yaml", None, False),
        ("sh", None, None, True),
        ("text", None, None, False),
        ("python", "train.py", None, False),
        ("bash", None, None, True),
    ]
    assert blocks[0].line == 3 and blocks[0].code == "echo hi\n"
    assert blocks[3].code == "ls\n"  # the admonition's indentation removed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{FENCE}\nx\n{FENCE}\n", "without a language"),
        (f"<!-- not-run -->\n{FENCE}bash\nx\n{FENCE}\n", "gives no reason"),
        (f"<!-- not-run: -->\n{FENCE}bash\nx\n{FENCE}\n", "gives no reason"),
        (f"<!-- not-run: output -->\n{FENCE}text\nx\n{FENCE}\n", "not run anyway"),
        (
            f'<!-- not-run: a file -->\n{FENCE}yaml title="a.yaml"\nx\n{FENCE}\n{FENCE}bash\ncat a.yaml\n{FENCE}\n',
            "not run anyway",
        ),
        ("<!-- not-run: nothing follows -->\n\ntext\n", "last non-blank line before a fence"),
        (
            f'{FENCE}yaml title="../a.yaml"\nx\n{FENCE}\n{FENCE}bash\ncat ../a.yaml\n{FENCE}\n',
            "relative path inside",
        ),
        (f"{FENCE}bash\nx\n", "never closed"),
        (f"{FENCE}console\n$ ddp-rank --help\n{FENCE}\n", "neither run"),
        (f"{FENCE}pycon\n>>> 1 + 1\n{FENCE}\n", "neither run"),
        (f"{FENCE}zsh\nls\n{FENCE}\n", "neither run"),
        (f"{FENCE}shell-session\n$ ls\n{FENCE}\n", "neither run"),
        (f"{FENCE}ipython\nIn [1]: 1\n{FENCE}\n", "neither run"),
        (
            f'{FENCE}yaml title="unused.yaml"\na: 1\n{FENCE}\n\n{FENCE}bash\nls\n{FENCE}\n',
            "no later block uses",
        ),
    ],
)
def test_parse_reports_bad_fences_and_markers(text: str, message: str) -> None:
    _, problems = parse(text, "p.md")
    assert len(problems) == 1 and message in problems[0] and problems[0].startswith("p.md:")


def test_a_marker_shown_inside_a_longer_fence_is_an_example_not_a_marker() -> None:
    text = f"````markdown\n<!-- not-run: needs a GPU -->\n{FENCE}bash\nx\n{FENCE}\n````\n"
    blocks, problems = parse(text, "p.md")
    assert problems == [] and [b.lang for b in blocks] == ["markdown"]


def test_an_unmarked_failing_block_fails_the_page_and_stops_it(tmp_path: Path) -> None:
    result, folder = run(
        tmp_path,
        f"{FENCE}bash\necho before\nfalse\necho never\n{FENCE}\n\n{FENCE}bash\ntouch later\n{FENCE}\n",
    )
    failed = result.failure
    assert failed is not None and failed.block.line == 1 and "before" in failed.output
    assert "never" not in failed.output and not (folder / "later").exists()
    assert "page.md:1" in result.report()


def test_a_failing_pipeline_and_an_unset_variable_fail(tmp_path: Path) -> None:
    assert run(tmp_path, f"{FENCE}bash\nfalse | cat\n{FENCE}\n")[0].failure is not None
    assert run(tmp_path, f"{FENCE}sh\necho $NOT_SET_ANYWHERE\n{FENCE}\n", "b.md")[0].failure is not None


@pytest.mark.parametrize(
    "code",
    [
        'x="$(false; echo still)"\necho "after: $x"',  # set -e inside the substitution (inherit_errexit)
        "count=$(false | wc -l)\necho $count",  # a failing non-final element of a substituted pipeline
        "false | true | cat\necho after",  # a failing non-final pipeline element
        "f() { false; echo inside; }\nout=$(f)\necho $out",
    ],
)
def test_a_failure_inside_a_substitution_or_a_pipeline_fails_the_block(tmp_path: Path, code: str) -> None:
    result, _ = run(tmp_path, f"{FENCE}bash\n{code}\n{FENCE}\n")
    failed = result.failure
    assert failed is not None, f"this block passed: {code!r}"
    assert "after" not in failed.output and "inside" not in failed.output


def test_an_unknown_language_in_a_titled_block_is_a_file() -> None:
    text = f'{FENCE}ini title="setup.cfg"\n[x]\n{FENCE}\n\n{FENCE}bash\ncat setup.cfg\n{FENCE}\n'
    assert parse(text, "p.md")[1] == []


def test_a_marked_block_is_skipped(tmp_path: Path) -> None:
    result, _ = run(tmp_path, f"<!-- not-run: needs a GPU -->\n{FENCE}bash\nexit 1\n{FENCE}\n")
    assert result.failure is None and [o.status for o in result.outcomes] == ["not run"]


def test_a_failing_python_block_reports_the_page_line(tmp_path: Path) -> None:
    result, _ = run(tmp_path, f"# T\n\n{FENCE}python\nx = 1\nraise RuntimeError('boom')\n{FENCE}\n")
    failed = result.failure
    assert failed is not None and "boom" in failed.output and 'page.md:3", line 5' in failed.output


def test_titled_blocks_are_written_and_later_blocks_read_them(tmp_path: Path) -> None:
    text = f"""{FENCE}yaml title="configs/tiny.yaml"
train:
  steps: 3
{FENCE}

{FENCE}python title="hello.py"
import sys
print("hello", sys.argv[1])
{FENCE}

{FENCE}bash
grep -q 'steps: 3' configs/tiny.yaml
grep -q 'steps: 2' configs/demo.yaml
python hello.py there > said.txt
{FENCE}

{FENCE}python
assert open("said.txt").read() == "hello there\\n"
{FENCE}
"""
    result, folder = run(tmp_path, text)
    assert result.failure is None, result.report()
    assert [o.status for o in result.outcomes] == ["written", "written", "ran", "ran"]
    assert (folder / "configs" / "tiny.yaml").read_text() == "train:\n  steps: 3\n"


def test_bash_blocks_share_exports_and_directory_python_blocks_a_namespace(tmp_path: Path) -> None:
    text = f"""{FENCE}bash
export GREETING=hi
LOCAL_ONLY=x
mkdir sub && cd sub
{FENCE}

{FENCE}bash
test "$GREETING" = hi
test -z "${{LOCAL_ONLY:-}}"
test "$(basename "$PWD")" = sub
test -d "$DDP_RANK_REPO/configs"
command -v python
{FENCE}

{FENCE}python
import os
value = 41
{FENCE}

{FENCE}python
assert value + 1 == 42
assert os.path.isdir("configs")
{FENCE}
"""
    result, _ = run(tmp_path, text)
    assert result.failure is None, result.report()


def test_pages_are_isolated(tmp_path: Path) -> None:
    first, folder_a = run(
        tmp_path,
        f"{FENCE}bash\nexport ONE=1\ntouch mine\n{FENCE}\n\n{FENCE}python\nshared = 1\n{FENCE}\n",
        "a.md",
    )
    second, folder_b = run(
        tmp_path,
        f"{FENCE}bash\ntest ! -e mine\ntest -z \"${{ONE:-}}\"\n{FENCE}\n\n{FENCE}python\nassert 'shared' not in globals()\n{FENCE}\n",
        "b.md",
    )
    assert first.failure is None and second.failure is None, second.report()
    assert (folder_a / "mine").exists() and folder_a != folder_b


def test_a_hung_block_times_out(tmp_path: Path) -> None:
    result, _ = run(tmp_path, f"{FENCE}bash\nsleep 30\n{FENCE}\n", timeout=0.3)
    assert result.failure is not None and "timed out" in result.failure.output
    result, _ = run(tmp_path, f"{FENCE}python\nimport time\ntime.sleep(30)\n{FENCE}\n", "p.md", timeout=0.3)
    assert result.failure is not None and "timed out" in result.failure.output


def test_a_page_with_a_bad_marker_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="gives no reason"):
        run(tmp_path, f"<!-- not-run -->\n{FENCE}bash\ntouch ran\n{FENCE}\n")


def test_a_marker_named_inside_a_sentence_is_prose() -> None:
    _, problems = parse("Write `<!-- not-run: why -->` before the fence.\n\ntext\n", "p.md")
    assert problems == []


# A console script that says how it was run: tests/docs/warm_server.py runs it forked from a warm server.
FAKE_CLI = """#!{python}
import os, signal, sys, time

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["wait"]:
        signal.signal(signal.SIGUSR1, lambda *_: sys.exit(75))
        print(os.getpid(), flush=True)
        while True:
            time.sleep(0.05)
    if args[:1] == ["exit"]:
        sys.exit(int(args[1]))
    print("argv", args, "cwd", os.path.basename(os.getcwd()), "colour", os.environ.get("COLOUR"),
          "main", __name__, "script", os.path.basename(sys.argv[0]), "stdin", sys.stdin.read().strip(),
          "colorsys", "colorsys" in sys.modules, "difflib", "difflib" in sys.modules)
    print("to stderr", file=sys.stderr)
"""


def warm_run(tmp_path: Path, code: str, timeout: float = 60) -> tuple[object, Path]:
    """``code`` as one bash block of a page whose ``fake-cli`` runs warm (colorsys preloaded, difflib too for
    ``fake-cli heavy`` unless ``--help`` is given)."""
    repo, path = page(tmp_path, f"{FENCE}bash\n{code}{FENCE}\n")
    script = repo / "fake-cli"
    script.write_text(FAKE_CLI.format(python=sys.executable))
    script.chmod(0o755)
    warm = WarmCommand(
        "fake-cli",
        preload=("colorsys",),
        by_subcommand=(("heavy", ("colorsys", "difflib")),),
        plain_flags=frozenset({"--help"}),
        script=script,
    )
    folder = tmp_path / "run"
    folder.mkdir()
    env = {**os.environ, "PATH": os.pathsep.join([str(repo), os.environ["PATH"]])}  # the script itself: cold
    return run_page(path, repo, folder, env=env, timeout=timeout, warm=[warm]), folder


def test_a_warm_command_has_the_blocks_arguments_folder_environment_and_streams(tmp_path: Path) -> None:
    result, folder = warm_run(
        tmp_path,
        """mkdir sub && cd sub
export COLOUR=red                 # differs from the server's environment: this call runs cold
echo cold | fake-cli > ../cold.txt
unset COLOUR
echo piped | fake-cli one 'two words' > ../warm.txt 2> ../err.txt
fake-cli heavy | grep -q 'difflib True'
fake-cli heavy --help | grep -q 'difflib False'
status=0; fake-cli exit 3 || status=$?
test $status -eq 3
""",
    )
    assert result.failure is None, result.report()
    warm = (folder / "warm.txt").read_text()
    assert warm == (
        "argv ['one', 'two words'] cwd sub colour None main __main__ script fake-cli stdin piped "
        "colorsys True difflib False\n"
    )
    assert (folder / "err.txt").read_text() == "to stderr\n"
    cold = (folder / "cold.txt").read_text()
    assert "colour red" in cold and "stdin cold" in cold and "colorsys False" in cold


def test_a_warm_command_gets_the_signals_sent_to_it_and_ends_as_they_end_it(tmp_path: Path) -> None:
    result, _ = warm_run(
        tmp_path,
        """for sig in USR1 TERM; do
    fake-cli wait > "$sig.log" &
    pid=$!
    for _ in $(seq 200); do test -s "$sig.log" && break; sleep 0.05; done
    kill -$sig $pid
    status=0; wait $pid || status=$?
    echo "$sig $status" >> statuses
done
test "$(cat statuses)" = "$(printf 'USR1 75\\nTERM 143')"
""",
    )
    assert result.failure is None, result.report()


def test_a_timed_out_block_takes_its_warm_command_with_it(tmp_path: Path) -> None:
    result, folder = warm_run(tmp_path, "fake-cli wait > pid.txt\n", timeout=1.5)
    assert result.failure is not None and "timed out" in result.failure.output
    pid = int((folder / "pid.txt").read_text())
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the warm command {pid} outlived its timed-out block")


def test_docs_warm_0_runs_every_command_cold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCS_WARM", "0")
    result, folder = warm_run(tmp_path, "fake-cli > out.txt\n")
    assert result.failure is None, result.report()
    assert "colorsys False" in (folder / "out.txt").read_text()
