"""Run outputs: metrics JSONL (append, truncate on resume) handed to the trackers, plots, summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_rank.train.run_outputs import MetricsLogger, read_metrics, write_plots, write_summary


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
    records = [
        {"kind": "train", "step": s, "loss": 1.0 / s, "lr_backbone": 1e-5 * s, "lr_head": 1e-4 * s,
         "images_per_s": 100.0 + s}
        for s in (1, 2, 3)
    ]  # fmt: skip
    records += [
        {"kind": "eval", "step": s, "recall@1": 0.1 * s, "recall@10": 0.2 * s, "map@r": 0.05 * s} for s in (0, 3)
    ]
    plots = write_plots(records, tmp_path)
    assert [p.name for p in plots] == ["loss.png", "recall.png", "lr.png", "throughput.png"]
    assert all(p.stat().st_size > 1000 for p in plots)
    summary = write_summary(
        tmp_path / "summary.md", title="Run x", config={"train": {"steps": 3}}, records=records,
        facts={"processes": 2}, tables={"Evaluation": "| a |"}, plots=plots,
    )  # fmt: skip
    text = summary.read_text()
    assert "# Run x" in text and "**processes**: 2" in text and "![recall](recall.png)" in text
    assert "recall@1 30.00" in text and "steps: 3" in text


def test_finite_numbers_reach_the_trackers(tmp_path: Path) -> None:
    seen: list[tuple[str, int, dict[str, float]]] = []
    log = MetricsLogger(tmp_path / "m.jsonl", lambda kind, step, values: seen.append((kind, step, values)))
    log.log("train", 1, {"loss": 0.5, "lr": float("nan"), "bad_shards": ["a.tar"], "chunks": 2, "flag": True})
    log.close()
    log.log("train", 2, {"loss": 0.25})  # closed: the JSONL only
    assert seen == [("train", 1, {"loss": 0.5, "chunks": 2.0})]
    assert [r["loss"] for r in read_metrics(tmp_path / "m.jsonl")] == [0.5, 0.25]


def test_step_line_and_durations() -> None:
    from ddp_rank.train.console import StepLine, format_duration

    assert format_duration(3725.4) == "1:02:05" and format_duration(90061) == "1d 1:01:01"
    line = StepLine(step=120, total=330, epoch=0.3636, loss=0.41234, images_per_s=1520.4, data_time=0.0123,
                    lrs=[1e-5, 1e-4], memory="12.3 GiB", eta_s=312)  # fmt: skip
    assert str(line) == (
        "step 120/330 (epoch 0.36) loss 0.4123 | 1520 img/s | data 0.012 s/step | lr 1.0e-05 / 1.0e-04 | "
        "mem 12.3 GiB | ETA 0:05:12"
    )


@pytest.mark.slow
def test_a_run_without_a_terminal_reports_what_it_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No TTY (as in a SLURM log): a timestamped line per log_every steps, the evaluation's table, the
    checkpoints, the best model, and on a second start the resume."""
    import re

    from ddp_rank.config import load_config
    from ddp_rank.train.trainer import run_training
    from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

    shards = build_tiny_shards(tmp_path / "data")
    args = [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", "train.log_every=2",
            "train.eval_every=4", "train.progress=true"]  # fmt: skip
    run_training(load_config(None, [*args, "train.steps=4"]))
    out = capsys.readouterr().out
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    steps = re.findall(rf"^{stamp} step (\d+)/4 \(epoch [\d.]+\) loss [\d.]+ \| \d+ img/s \| data [\d.]+ s/step \| "
                       rf"lr [\d.e+-]+ / [\d.e+-]+ \| mem [\d.]+ GiB RSS \| ETA \d+:\d\d:\d\d$", out, re.M)  # fmt: skip
    assert steps == ["2", "4"], out
    assert re.search(rf"^{stamp} training steps 1-4 with 1 process\(es\) on cpu", out, re.M), out
    assert re.search(rf"^{stamp} evaluation at step 4 \(test\):\n.*R@1", out, re.M), out
    assert re.search(rf"^{stamp} checkpoint .*step-00000004$", out, re.M), out
    assert re.search(rf"^{stamp} new best recall@1 [\d.]+ at step 4$", out, re.M), out

    run_training(load_config(None, [*args, "train.steps=6", "train.force_resume=true"]))
    out = capsys.readouterr().out
    assert re.search(rf"^{stamp} resumed from .*step-00000004 at step 4 of 6$", out, re.M), out
    kept = (tmp_path / "run" / "train.log").read_text()  # both starts, kept in the run directory
    assert kept.count("training steps") == 2 and "INFO ddp_rank.train.run_report: resumed from" in kept
    assert re.search(rf"^{stamp} rank 0 INFO ddp_rank.train.trainer: checkpoint .*step-00000006$", kept, re.M)
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in recs if r["kind"] == "train"]
    assert all({"lr_backbone", "lr_head", "data_replaced_classes"} <= set(r) for r in train)
