"""Every tutorial's blocks run, in page order, in a fresh copy of the repository (docs/code-blocks.md); the
other pages are in tests/docs/test_code_blocks.py. A file of its own so that the suite's workers (one file
each) share the runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.code_blocks import doc_pages, run_page
from tests.docs.test_code_blocks import WARM, _id, _runs_something, _starts_processes, _tutorial, page_params
from tests.helpers.training import cpu_env

REPO = Path(__file__).resolve().parents[2]
TUTORIALS = [p for p in doc_pages(REPO) if _tutorial(p) and _runs_something(p)]


def test_there_are_tutorials_to_run() -> None:
    assert len(TUTORIALS) >= 6, [_id(p) for p in TUTORIALS]


def test_the_tutorials_that_launch_several_processes_are_marked_distributed() -> None:
    launching = {_id(p) for p in TUTORIALS if _starts_processes(p)}
    assert {"docs/tutorials/own-training-loop.md", "docs/tutorials/slurm.md"} <= launching
    assert "docs/tutorials/one-gpu-chunks.md" not in launching


@pytest.mark.slow
@pytest.mark.parametrize("page", page_params(TUTORIALS))
def test_tutorial_runs(page: Path, tmp_path: Path) -> None:
    result = run_page(page, REPO, tmp_path, env=cpu_env(), warm=WARM)
    assert result.ok, result.report()
