"""Run outputs: metrics JSONL (append, truncate on resume), optional TensorBoard, plots, summary."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from ddp_rank.train.reporting import MetricsLogger, read_metrics, write_plots, write_summary


def test_jsonl_append_and_truncate_after_resume(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3, 4):
        log.log("train", s, {"loss": 1.0 / s})
    log.log("eval", 4, {"recall@1": 0.5, "recall@10": 0.9})
    with (tmp_path / "metrics.jsonl").open("a") as fh:
        fh.write('{"kind": "train", "st')  # a line cut by a kill
    assert log.truncate_after(2) == 4  # steps 3, 4, the eval at 4, the cut line
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    log.close()


def test_plots_and_summary(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    records = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3)]
    records += [{"kind": "eval", "step": s, "recall@1": 0.1 * s, "recall@10": 0.2 * s} for s in (0, 3)]
    plots = write_plots(records, tmp_path)
    assert [p.name for p in plots] == ["loss.png", "recall.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    summary = write_summary(
        tmp_path / "summary.md", title="Run x", config={"train": {"steps": 3}}, records=records,
        facts={"processes": 2}, tables={"Evaluation": "| a |"}, plots=plots,
    )  # fmt: skip
    text = summary.read_text()
    assert "# Run x" in text and "**processes**: 2" in text and "![recall](recall.png)" in text
    assert "recall@1 30.00" in text and "steps: 3" in text


def test_tensorboard_missing_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails as if not installed
    with pytest.raises(RuntimeError, match="pip install tensorboard"):
        MetricsLogger(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_events(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    log.log("train", 1, {"loss": 0.5})
    log.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
