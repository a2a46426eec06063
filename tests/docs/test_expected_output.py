"""A page's claims about output (tests/docs/expected_output.py) and the folder its blocks run in
(tests/docs/page_tree.py): the matcher's rules, the markers' checks, the copy of the whole tree and the check
that a page writes only under ignored folders (docs/code-blocks.md)."""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

import pytest

from tests.docs.code_blocks import doc_pages, parse, run_page
from tests.docs.expected_output import match_output
from tests.docs.page_tree import (
    copy_repository,
    is_ignored,
    read_ignore_rules,
    repository_files,
    stray_writes,
)

FENCE = "```"
LOG = """2026-11-28 20:02:04 [rank 1] step 3/3 loss 0.7914
2026-11-28 20:02:04 step 3/3 loss 0.7914 | 786 img/s
split  category  classes
test   chairs          2
train  TOTAL          12
done: 3 steps
"""


@pytest.mark.parametrize(
    "expected",
    [
        "split  category  classes\ntest   chairs          2",  # lines in a row, anywhere in the output
        "... step 3/3 loss 0.7914 | ... img/s",  # ... inside a line: any text
        "split  category  classes\n...\ndone: 3 steps",  # ... alone: any number of lines
        "... [rank 1] step 3/3 loss {{loss}}\n... step 3/3 loss {{loss}} | ...",  # the same value twice
        "\ntest   chairs          2   \n\n",  # blank ends and trailing spaces are not compared
    ],
)
def test_the_output_holds_the_expected_lines(expected: str) -> None:
    assert match_output(expected, LOG) is None


@pytest.mark.parametrize(
    ("expected", "line"),
    [
        ("split  category  classes\ntrain  TOTAL          12", 2),  # not in a row without a ... line
        ("test   chairs          3", 1),
        ("done: 3 steps\nsplit  category  classes", 2),  # out of order
        ("step 3/3 loss 0.7914 | 786 img/s", 1),  # a line matches whole: the timestamp is not optional
        ("... [rank 1] step 3/3 loss {{loss}}\n...\ndone: {{loss}} steps", 3),  # a name keeps its value
    ],
)
def test_a_mismatch_names_the_first_expected_line_not_found(expected: str, line: int) -> None:
    mismatch = match_output(expected, LOG)
    assert mismatch is not None and mismatch.line == line, mismatch


def test_a_name_repeated_within_a_line_must_repeat_its_value() -> None:
    assert match_output("... step {{n}}/{{n}} loss ...", "x step 3/3 loss 1") is None
    assert match_output("... step {{n}}/{{n}} loss ...", "x step 3/4 loss 1") is not None


def test_any_order_takes_each_line_from_anywhere_once_with_shared_values() -> None:
    ranks = "rank 1 step 3 loss 0.42\nrank 1 sum -0.19\nrank 0 step 3 loss 0.42\nrank 0 sum -0.19\n"
    expected = (
        "rank 0 step 3 loss {{loss}}\nrank 1 step 3 loss {{loss}}\n...\nrank 0 sum {{s}}\nrank 1 sum {{s}}"
    )
    assert match_output(expected, ranks) is not None  # in order, rank 0's line is not first
    assert match_output(expected, ranks, any_order=True) is None
    differ = ranks.replace("rank 0 step 3 loss 0.42", "rank 0 step 3 loss 0.43")
    mismatch = match_output(expected, differ, any_order=True)
    assert mismatch is not None and mismatch.line == 2, mismatch  # rank 1 does not print rank 0's loss
    twice = "rank 0 sum 1\n"
    assert (
        match_output("rank 0 sum 1\nrank 0 sum 1", twice, any_order=True) is not None
    )  # one line, one match


def test_a_mismatch_says_which_line_and_the_values_it_had() -> None:
    mismatch = match_output("... [rank 1] step 3/3 loss {{loss}}\n...\nnot printed {{loss}}", LOG)
    assert mismatch is not None
    assert mismatch.describe() == (
        "line 3 of the expected output, 'not printed {{loss}}', is not in the output (with {{loss}}='0.7914')"
    )


def _page(tmp_path: Path, text: str) -> tuple[Path, Path]:
    repo = tmp_path / "repo"
    (repo / "configs").mkdir(parents=True)
    (repo / "configs" / "demo.yaml").write_text("a: 1\n")
    (repo / ".gitignore").write_text("/runs/\n__pycache__/\n")
    (repo / "page.md").write_text(text)
    return repo, repo / "page.md"


def _run(tmp_path: Path, text: str):
    repo, page = _page(tmp_path, text)
    folder = tmp_path / "run"
    folder.mkdir()
    return run_page(page, repo, folder, timeout=30)


def test_an_expected_output_block_is_compared_with_the_block_before_it(tmp_path: Path) -> None:
    text = f"{FENCE}bash\necho 'loss 0.5'; echo 'loss 0.5' >&2\n{FENCE}\n\n<!-- expected-output -->\n{FENCE}text\n"
    good = _run(tmp_path / "good", text + f"loss {{{{x}}}}\nloss {{{{x}}}}\n{FENCE}\n")
    assert good.ok, good.report()
    assert [o.status for o in good.outcomes] == ["ran", "matched"]
    unordered = text.replace("<!-- expected-output -->", "<!-- expected-output: any order -->")
    unordered_run = _run(tmp_path / "unordered", unordered + f"loss {{{{x}}}}\nloss 0.{{{{y}}}}\n{FENCE}\n")
    assert unordered_run.ok, unordered_run.report()
    bad = _run(tmp_path / "bad", text + f"loss 0.5\nloss 0.6\n{FENCE}\n\n{FENCE}bash\ntouch never\n{FENCE}\n")
    assert [o.status for o in bad.outcomes] == ["ran", "failed"]  # the page stops there
    assert bad.report().startswith(
        "page.md:6: the expected output does not match what the block before it printed: line 2 of the expected "
        "output, 'loss 0.6', is not in the output"
    ), bad.report()


def test_an_expected_output_without_output_to_check_is_refused() -> None:
    data_before = f"{FENCE}yaml\na: 1\n{FENCE}\n<!-- expected-output -->\n{FENCE}text\nx\n{FENCE}\n"
    _, problems = parse(data_before, "p.md")
    assert problems == [
        "p.md:5: an expected-output block checks the output of the block right before it, here the block at "
        "p.md:1, which does not run; put it after the ```bash or ```python block whose output it shows, or drop "
        "the marker"
    ]
    _, problems = parse(f"<!-- expected-output -->\n{FENCE}text\nx\n{FENCE}\n", "p.md")
    assert "here no block" in problems[0]
    _, problems = parse(
        f"{FENCE}bash\ntrue\n{FENCE}\n<!-- expected-output -->\n{FENCE}bash\nx\n{FENCE}\n", "p.md"
    )
    assert problems == [
        "p.md:5: <!-- expected-output --> goes before an untitled ```text block (the output), not a ```bash"
    ]
    _, problems = parse(f"{FENCE}bash\ntrue\n{FENCE}\n<!-- expected-output: x -->\n\ntext\n", "p.md")
    assert problems == [
        "p.md:4: an expected-output marker must be the last non-blank line before a ```text fence, alone on its "
        "line, as <!-- expected-output --> or <!-- expected-output: any order -->"
    ]


def test_a_page_runs_in_a_copy_of_every_file_of_the_repository(tmp_path: Path) -> None:
    repo, page = _page(tmp_path, f"{FENCE}bash\ntest -f configs/demo.yaml && test -f page.md\n{FENCE}\n")
    (repo / "shards").mkdir()
    (repo / "shards" / "README.md").write_text("recipes\n")
    (repo / "runs").mkdir()
    (repo / "runs" / "old.json").write_text("{}\n")  # ignored: a clone has no runs/
    page.write_text(
        page.read_text() + f"{FENCE}bash\ntest -f shards/README.md && test ! -e runs/old.json\n{FENCE}\n"
    )
    folder = tmp_path / "run"
    folder.mkdir()
    result = run_page(page, repo, folder, timeout=30)
    assert result.ok, result.report()


def test_a_page_that_writes_outside_the_ignored_folders_fails(tmp_path: Path) -> None:
    writes = "mkdir -p runs/page && echo x > runs/page/ok && mkdir shards && echo x > shards/manifest.json"
    result = _run(tmp_path, f"{FENCE}bash\n{writes}\necho b >> configs/demo.yaml\n{FENCE}\n")
    assert result.failure is None and not result.ok
    assert result.stray == ["configs/demo.yaml (changed)", "shards/manifest.json (new)"]
    assert "write under runs/<page>/ (runs/ is in .gitignore)" in result.report()


def test_the_listing_of_an_export_is_the_listing_of_its_checkout(tmp_path: Path) -> None:
    """An export without .git (a tarball) walks the tree less the .gitignore: the same files git lists."""
    repo, _ = _page(tmp_path, "# p\n")
    for name in ("runs/a.json", "x/__pycache__/m.pyc", "x/m.py", "build/lib.txt", "sub/build/y.txt"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text("x\n")
    (repo / ".gitignore").write_text("/runs/\n__pycache__/\nbuild/\n*.pyc\n")
    exported = repository_files.__wrapped__(repo)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    assert repository_files.__wrapped__(repo) == exported
    assert exported == (".gitignore", "configs/demo.yaml", "page.md", "x/m.py")


def test_ignore_rules_follow_git_for_the_forms_this_repository_uses() -> None:
    rules = read_ignore_rules("/runs/\n__pycache__/\n*.egg-info/\nbuild/\n")
    assert is_ignored(PurePosixPath("runs/x/y.json"), False, rules)
    assert not is_ignored(
        PurePosixPath("docs/runs"), False, rules
    )  # a file named runs: the rule is a folder's
    assert not is_ignored(PurePosixPath("docs/runs/a.md"), False, rules)  # anchored at the root
    assert is_ignored(PurePosixPath("a/b/__pycache__/m.pyc"), False, rules)
    assert is_ignored(PurePosixPath("ddp_rank.egg-info"), True, rules)
    with pytest.raises(ValueError, match=r"^x:2: '!keep' uses a \.gitignore feature"):
        read_ignore_rules("a\n!keep\n", "x")


def test_the_copy_keeps_modes_and_a_changed_copy_leaves_the_repository_alone(tmp_path: Path) -> None:
    repo, _ = _page(tmp_path, "# p\n")
    (repo / "run.sh").write_text("#!/bin/sh\n")
    (repo / "run.sh").chmod(0o755)
    folder = tmp_path / "copy"
    copied = copy_repository(repo, folder)
    assert (folder / "run.sh").stat().st_mode & 0o111
    (folder / "configs" / "demo.yaml").write_text("changed\n")
    assert (repo / "configs" / "demo.yaml").read_text() == "a: 1\n"
    assert stray_writes(folder, copied) == ["configs/demo.yaml (changed)"]


def test_the_rendered_result_files_are_pages_the_suite_checks() -> None:
    repo = Path(__file__).resolve().parents[2]
    results = [p for p in doc_pages(repo) if p.parent == repo / "benchmarks" / "results"]
    assert results and all(p.suffix == ".md" for p in results)
