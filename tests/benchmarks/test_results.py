"""The benchmarks' dated result files: a second run on the same day is added, never written over."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import common


def test_a_second_run_on_the_same_day_is_appended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path)
    first = common.write_result("loss", "Loss layer", "| a |\n|---|\n| 1 |")
    first.write_text(first.read_text() + "\nNotes: the first table.\n")
    second = common.write_result("loss", "Loss layer", "| a |\n|---|\n| 2 |")
    assert second == first
    text = first.read_text()
    assert text.startswith("# Loss layer\n")
    assert text.count("# Loss layer") == 1
    assert (
        text.index("| 1 |")
        < text.index("Notes: the first table.")
        < text.index("## Run of ")
        < text.index("| 2 |")
    )
