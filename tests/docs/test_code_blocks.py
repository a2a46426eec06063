"""Every fenced block of README.md and docs/**/*.md: well formed, and run (docs/code-blocks.md).

The fences and markers are checked for every page (fast); the blocks of each page then run in a fresh copy of
the repository, in page order (slow: the tutorials build tiny shards and train a few steps). An unmarked bash or
python block that fails, an expected-output block that does not match, or a file written outside the ignored
folders fails its page's test with the block or the paths, its page:line and the end of its output.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.code_blocks import WarmCommand, doc_pages, parse, run_page
from tests.helpers.training import cpu_env

REPO = Path(__file__).resolve().parents[2]
PAGES = doc_pages(REPO)
# The pages run some fifty `ddp-rank` commands; each spent 2 s of CPU importing torch before it did anything, a
# training run more (accelerate, torch._dynamo for the optimizer). They run forked from a server that imported
# those once (tests/docs/warm_server.py): every command imports torch, every `train` that trains the other two,
# so a command finds done only the imports it would do.
WARM = (
    WarmCommand(
        "ddp-rank",
        preload=("torch",),
        by_subcommand=(("train", ("torch", "accelerate", "torch._dynamo")),),
        plain_flags=frozenset({"-h", "--help", "--help-config"}),
    ),
)


def _id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def _runs_something(page: Path) -> bool:
    blocks, _ = parse(page.read_text(encoding="utf-8"), _id(page))
    return any(block.runs for block in blocks)


# A launcher in a block the suite runs: the page's test starts several processes.
_LAUNCHER = re.compile(r"\baccelerate\s+launch\b|\btorchrun\b|\bpython\s+-m\s+torch\.distributed\.run\b")


def _starts_processes(page: Path) -> bool:
    blocks, _ = parse(page.read_text(encoding="utf-8"), _id(page))
    return any(block.runs and _LAUNCHER.search(block.code) for block in blocks)


def page_params(pages: list[Path]) -> list[object]:
    """``pages`` as test parameters, those that start several processes marked ``distributed`` (as every test
    that starts several processes is, docs/contributing.md), by their path as id."""
    return [
        pytest.param(page, id=_id(page), marks=[pytest.mark.distributed] if _starts_processes(page) else [])
        for page in pages
    ]


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_fences_and_markers_are_well_formed(page: Path) -> None:
    _, problems = parse(page.read_text(encoding="utf-8"), _id(page))
    assert not problems, "\n".join(problems)


def _tutorial(page: Path) -> bool:
    return page.parent.name == "tutorials"


@pytest.mark.slow
@pytest.mark.parametrize("page", page_params([p for p in PAGES if _runs_something(p) and not _tutorial(p)]))
def test_code_blocks_run(page: Path, tmp_path: Path) -> None:
    """The pages but the tutorials (tests/docs/test_tutorials_run.py: a file of their own, so that the suite's
    workers, one file each, run the two halves side by side)."""
    result = run_page(page, REPO, tmp_path, env=cpu_env(), warm=WARM)
    assert result.ok, result.report()
