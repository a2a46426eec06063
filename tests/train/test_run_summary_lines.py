"""The start line and the summary read right for any ``train.log_every`` and for a resumed run that had already
finished: no ``loss x (step 4) -> x (step 4)``, no ``training steps 41-40``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ddp_rank.train.run_outputs import write_summary
from ddp_rank.train.run_report import steps_to_train


def test_what_a_start_trains() -> None:
    assert steps_to_train(0, 40, "on cpu") == "training steps 1-40 on cpu"
    assert steps_to_train(39, 40, "on cpu") == "training step 40 on cpu"
    finished = steps_to_train(40, 40, "on cpu")
    assert finished.startswith("nothing to train: step 40 of 40 is done") and "train.steps" in finished
    assert "41" not in finished and "on cpu" not in finished


def _summary(tmp_path: Path, steps: list[int]) -> str:
    records = [{"kind": "train", "step": s, "loss": 0.8 / s} for s in steps]
    path = write_summary(tmp_path / "summary.md", title="Run", config={}, records=records, facts={})
    return next(line for line in path.read_text().splitlines() if line.startswith("- **loss**"))


def test_the_loss_line_of_one_logged_step(tmp_path: Path) -> None:
    assert _summary(tmp_path, [4]) == "- **loss**: 0.2000 at step 4 (the only logged step)"


def test_the_loss_line_of_several_logged_steps(tmp_path: Path) -> None:
    assert _summary(tmp_path, [2, 4]) == "- **loss**: 0.4000 at step 2 -> 0.2000 at step 4"


@pytest.mark.slow
def test_a_finished_run_started_again(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """log_every above steps logs one step; starting the finished run again trains nothing and says so."""
    from ddp_rank.config import load_config
    from ddp_rank.train.trainer import run_training
    from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

    shards = build_tiny_shards(tmp_path / "data")
    args = [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", "train.steps=2"]
    args += ["train.log_every=10", "data.test_split="]
    run_training(load_config(None, args))
    first = (tmp_path / "run" / "summary.md").read_text()
    assert re.search(r"^- \*\*loss\*\*: [\d.]+ at step 2 \(the only logged step\)$", first, re.M), first
    capsys.readouterr()
    run_training(load_config(None, args))
    out = capsys.readouterr().out
    assert "nothing to train: step 2 of 2 is done" in out and "training steps 3-2" not in out, out
    summary = (tmp_path / "run" / "summary.md").read_text()
    assert "- **time**: none: the run had already finished" in summary, summary
