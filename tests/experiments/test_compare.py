"""``compare`` on run directories with known metrics: only the settings that differ, best vs last, time and speed;
a crashed, a stopped, a running, a killed and an older run listed as such; markdown, CSV and JSON; the plot;
the run paths from globs and sweep folders."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config, save_config
from ddp_rank.experiments.compare import compare_runs
from ddp_rank.experiments.runs import expand_run_paths, read_run
from ddp_rank.train.run_state import RUN_FILE, RunState


def make_run(
    root: Path,
    name: str,
    batch: int,
    recalls: list[float],
    status: str = "finished",
    eval_every: int = 5,
    lr: float = 1e-4,
) -> Path:
    """A run directory as the trainer leaves it: config, metrics (evaluations every ``eval_every`` steps with
    ``recalls``), run.json in ``status``."""
    run = root / name
    cfg = load_config(None, [f"data.global_batch_size={batch}", f"train.output_dir={run}", f"optim.lr={lr}",
                             f"train.steps={eval_every * len(recalls)}"])  # fmt: skip
    save_config(cfg, run / "config.yaml")
    records = [{"kind": "data", "step": 0}]
    for i, r1 in enumerate(recalls, start=1):
        step = i * eval_every
        records.append({"kind": "train", "step": step, "loss": 0.5, "images_per_s": 100.0 * i})
        records.append({"kind": "eval", "step": step, "recall@1": r1, "recall@10": min(1.0, r1 + 0.1),
                        "map@r": r1 / 2, "num_queries": 40})  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    state = RunState(run)
    state.start()
    if status == "finished":
        state.finished(eval_every * len(recalls))
    elif status == "crashed":
        state.crashed(RuntimeError("CUDA out of memory"), eval_every * len(recalls) + 1)
    elif status == "stopped":
        state.stopped(eval_every * len(recalls))
    return run


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    root = tmp_path / "sweep"
    make_run(root, "bs=512", 512, [0.50, 0.70, 0.65])
    make_run(root, "bs=128", 128, [0.40, 0.60])
    make_run(root, "bs=2048", 2048, [0.30], status="crashed")
    make_run(root, "bs=32", 32, [0.2], status="stopped")
    running = make_run(root, "bs=64", 64, [0.25], status="running")  # this test's own process: alive
    dead = make_run(root, "bs=16", 16, [0.1], status="running")
    state = json.loads((dead / RUN_FILE).read_text())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    state["pid"] = child.pid  # a process that has ended
    (dead / RUN_FILE).write_text(json.dumps(state))
    older = make_run(root, "bs=8", 8, [0.15], status="finished")
    (older / RUN_FILE).unlink()
    (older / "summary.md").write_text("# Run\n")
    assert running.is_dir()
    return root


def test_every_run_is_listed_with_what_it_is(runs: Path) -> None:
    summaries = {p.name: read_run(p) for p in expand_run_paths([str(runs)])}
    assert {name: s.status for name, s in summaries.items()} == {
        "bs=8": "finished",  # an older run: no run.json, a summary.md
        "bs=16": "died",
        "bs=32": "stopped",
        "bs=64": "running",
        "bs=128": "finished",
        "bs=512": "finished",
        "bs=2048": "crashed",
    }
    assert list(summaries) == [
        "bs=8",
        "bs=16",
        "bs=32",
        "bs=64",
        "bs=128",
        "bs=512",
        "bs=2048",
    ]  # natural order
    assert "CUDA out of memory" in summaries["bs=2048"].detail
    big = summaries["bs=512"]
    assert big.best("recall@1") == (0.70, 10) and big.last("recall@1") == 0.65
    assert big.steps == 15 and big.images_seen == 15 * 512 and big.images_per_s == 200.0
    assert big.seconds is not None and big.seconds >= 0


def test_the_table_shows_only_the_settings_that_differ(runs: Path) -> None:
    table = compare_runs([read_run(p) for p in expand_run_paths([str(runs)])])
    assert table.keys == ["data.global_batch_size", "train.steps"]  # output_dir differs too but is left out
    assert table.metrics == ["recall@1", "recall@10", "map@r"]
    text = table.markdown()
    lines = text.splitlines()
    assert lines[0].startswith(
        "| run | status | data.global_batch_size | train.steps | steps | images seen |"
    )
    row = next(line for line in lines if line.startswith("| bs=512 |"))
    assert "| finished | 512 | 15 | 15 of 15 | 7,680 | 70.00 (step 10) | 65.00 | 75.00 | 32.50 |" in row
    assert "- bs=2048: crashed: RuntimeError: CUDA out of memory" in text
    assert "- bs=16: died: process" in text and "- bs=32: stopped: stopped on a signal" in text
    assert len([line for line in lines if line.startswith("| bs=")]) == 7


def test_csv_and_json_parse_with_one_row_per_run(runs: Path) -> None:
    table = compare_runs([read_run(p) for p in expand_run_paths([str(runs)])])
    rows = list(csv.DictReader(io.StringIO(table.csv())))
    assert len(rows) == 7 and rows[5]["data.global_batch_size"] == "512" and rows[5]["best recall@1"] == "0.7"
    data = json.loads(table.json())
    assert data["differing_keys"] == ["data.global_batch_size", "train.steps"]
    crashed = next(r for r in data["runs"] if r["run"].endswith("bs=2048"))
    assert crashed["status"] == "crashed" and crashed["last recall@1"] == 0.3


def test_the_command_takes_quoted_globs_and_draws_the_finished_runs(
    runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "compare.png"
    assert main(["compare", str(runs / "bs=1*"), str(runs / "bs=512"), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| bs=")] == [
        "| bs=16",
        "| bs=128",
        "| bs=512",
    ]
    assert plot.is_file() and plot.read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", str(runs), "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["runs"]) == 7


def test_bad_run_paths_and_metrics_are_refused_clearly(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["compare", str(runs / "nothing-here")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    assert main(["compare", str(runs / "nothing*")]) == 2
    assert "no run directory matches" in capsys.readouterr().err
    assert main(["compare", str(runs), "--metric", "recall@2"]) == 2
    assert "no run logged 'recall@2'; logged: recall@1, recall@10, map@r" in capsys.readouterr().err
    empty = runs / "empty"
    empty.mkdir()
    assert main(["compare", str(empty)]) == 2
    assert "holds no run" in capsys.readouterr().err


def test_run_state_adds_up_the_time_of_every_start_and_keeps_a_refused_start_out(tmp_path: Path) -> None:
    first = RunState(tmp_path)
    first.start()
    first.stopped(10)
    saved = json.loads((tmp_path / RUN_FILE).read_text())
    assert saved["status"] == "stopped" and saved["starts"] == 1 and saved["pid"] == os.getpid()
    second = RunState(tmp_path)
    second._t0 -= 5.0  # this start ran 5 s
    second.start()
    second.finished(20)
    state = json.loads((tmp_path / RUN_FILE).read_text())
    assert state["status"] == "finished" and state["starts"] == 2 and state["steps"] == 20
    assert state["seconds"] >= saved["seconds"] + 5.0
    refused = RunState(tmp_path)  # a start the trainer refused (before ``start``) leaves the state alone
    refused.crashed(ValueError("the output directory holds another run"), None)
    assert json.loads((tmp_path / RUN_FILE).read_text())["status"] == "finished"
    RunState(tmp_path / "fresh").crashed(ValueError("no shards"), None)  # a fresh run that failed to start
    assert json.loads((tmp_path / "fresh" / RUN_FILE).read_text())["status"] == "crashed"
    RunState(tmp_path / "rank1", enabled=False).start()
    assert not (tmp_path / "rank1").exists()
