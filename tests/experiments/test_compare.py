"""``compare`` on run directories with known metrics: only the settings that differ, best vs last, time and speed
(so far for a live run, unknown for a dead one); a crashed, a stopped, a running, a killed and an older run listed
as such; damaged metrics lines left out; markdown, CSV and JSON; the plot; the run paths from globs and sweep
folders, files and folders without a run among them passed over."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
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


def test_a_shell_expanded_sweep_folder_passes_over_its_files_with_a_note(
    runs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``compare runs/sweep/*`` unquoted: the shell also names the compare.md / compare.png the sweep wrote."""
    (runs / "compare.md").write_text("| run |\n")
    (runs / "compare.png").write_bytes(b"\x89PNG")
    (runs / "notes").mkdir()
    expanded = sorted(str(p) for p in runs.iterdir())
    assert main(["compare", *expanded, "--json"]) == 0
    captured = capsys.readouterr()
    assert len(json.loads(captured.out)["runs"]) == 7
    assert f"{runs / 'compare.md'} is a file, not a run directory: skipped" in captured.err
    assert f"{runs / 'notes'} holds no run" in captured.err
    assert main(["compare", str(runs / "compare.md"), str(runs / "notes")]) == 2
    err = capsys.readouterr().err
    assert f"error: no run directory among {runs / 'compare.md'} {runs / 'notes'}" in err


def test_damaged_metrics_lines_are_left_out(tmp_path: Path) -> None:
    run = make_run(tmp_path, "bs=64", 64, [0.5, 0.6])
    with (run / "metrics.jsonl").open("a") as f:
        f.write('[1, 2]\n"text"\n7\n{"kind": "train", "step": "ten", "images_per_s": 5.0}\n')
        f.write('{"kind": "eval", "step": null, "recall@1": 0.99}\n{"kind": "eval", "recall@1": 0.98}\n')
    summary = read_run(run)
    assert summary.steps == 10 and summary.best("recall@1") == (0.6, 10) and summary.images_per_s == 150.0
    assert "| 60.00 (step 10) |" in compare_runs([summary]).markdown()


def test_wall_time_is_so_far_for_a_live_run_and_unknown_for_a_dead_one(runs: Path) -> None:
    running = runs / "bs=64"
    state = json.loads((running / RUN_FILE).read_text())
    state["seconds"] = 5.0  # earlier starts
    state["started"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() - 100))
    (running / RUN_FILE).write_text(json.dumps(state))
    live = read_run(running)
    assert live.status == "running" and live.seconds is not None and 104 <= live.seconds < 200
    dead = read_run(runs / "bs=16")
    assert dead.status == "died" and dead.seconds is None
    row = next(line for line in compare_runs([dead]).markdown().splitlines() if line.startswith("| bs=16 |"))
    assert row.endswith("| - | 100.0 |")  # wall time unknown, not 0:00


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
    assert not (tmp_path / "fresh" / RUN_FILE).exists(), "a start that never began is not a run"
    third = RunState(tmp_path)  # a later start keeps the finished record's steps until it writes its own
    third.start()
    assert json.loads((tmp_path / RUN_FILE).read_text())["steps"] == 20
    third.crashed(ValueError("diverged"), 23)
    assert json.loads((tmp_path / RUN_FILE).read_text())["steps"] == 23
    RunState(tmp_path / "rank1", enabled=False).start()
    assert not (tmp_path / "rank1").exists()
