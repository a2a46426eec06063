"""Sweeps: the launch command of each point, resume (finished points skipped, interrupted ones continued, ones
another process still trains left alone), a failed point not stopping the others, a stopped one stopping the
sweep, ``--print`` (a launcher that decides on the machine that runs it), and one real sweep of two tiny points
through the trainer that ends with the comparison of both."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.experiments.grid import expand_grid
from ddp_rank.experiments.sweep import Launcher, point_command, point_dir, run_sweep
from ddp_rank.train.run_state import RUN_FILE, RunState
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


def train_points_in_this_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-process sweep's point commands run through the command line's ``main`` here instead of in a child
    Python (what ``subprocess.run`` adds, the interpreter and torch imported again, proves nothing more): each
    command must still start with the launcher's prefix, and its arguments are parsed as the child would."""
    import ddp_rank.experiments.sweep as sweep

    prefix = Launcher().prefix()

    def run(command: list[str]) -> int:
        assert command[: len(prefix)] == prefix, command
        return main(command[len(prefix) :])

    monkeypatch.setattr(sweep, "_run_command", run)


@pytest.fixture
def grid(tmp_path: Path) -> tuple[Path, list]:
    out = tmp_path / "sweep"
    _, points = expand_grid(None, ["loss.name=fastap,pnp,smoothap", f"train.output_dir={out}"])
    return out, points


def test_each_point_trains_into_its_own_folder_and_resumes(grid: tuple[Path, list]) -> None:
    out, points = grid
    command = point_command(Launcher(), "c.yaml", ["train.seed=3"], points[1], out)
    assert command[:3] == [sys.executable, "-m", "ddp_rank.cli"]
    assert command[3:] == ["train", "--config", "c.yaml", "train.seed=3", "loss.name=pnp",
                           f"train.output_dir={out / 'loss.name=pnp'}", "train.resume=auto"]  # fmt: skip
    accelerate = Launcher(processes=2, cpu=True).prefix()
    assert accelerate[1:3] == ["-m", "accelerate.commands.launch"] and accelerate[-2:] == [
        "-m",
        "ddp_rank.cli",
    ]
    assert accelerate[accelerate.index("--num_processes") + 1] == "2"
    assert accelerate[accelerate.index("--config_file") + 1].endswith("launch/accelerate_cpu_2proc.yaml")
    assert "--multi_gpu" in Launcher(processes=4, cpu=False).prefix()
    anywhere = Launcher(processes=4, cpu=None).prefix()  # --print: the machine that runs it decides
    assert (
        "--multi_gpu" in anywhere
        and "--config_file" not in anywhere
        and "--main_process_port" not in anywhere
    )
    assert Launcher(command="torchrun --nproc-per-node 8").prefix() == [
        "torchrun", "--nproc-per-node", "8", "-m", "ddp_rank.cli",
    ]  # fmt: skip


def test_finished_points_are_skipped_and_the_others_run_again(grid: tuple[Path, list]) -> None:
    out, points = grid
    commands = [(p, point_dir(out, p), [f"train {p.name}"]) for p in points]
    done = RunState(commands[0][1])
    done.start()
    done.finished(10)
    crashed = RunState(commands[1][1])
    crashed.start()
    crashed.crashed(RuntimeError("boom"), 3)
    ran: list[str] = []
    lines: list[str] = []
    outcome = run_sweep(commands, run=lambda c: ran.append(c[0]) or 0, say=lines.append)
    assert ran == ["train loss.name=pnp", "train loss.name=smoothap"]
    assert outcome.done == {commands[0][1]: "skipped", commands[1][1]: "finished", commands[2][1]: "finished"}
    assert "finished already, skipped" in lines[0] and "continuing a crashed run" in lines[1]


def test_a_point_another_process_still_trains_is_left_alone(grid: tuple[Path, list]) -> None:
    """Two trainers in one folder would write over each other's checkpoints; a dead one's point continues."""
    out, points = grid
    commands = [(p, point_dir(out, p), [p.name]) for p in points]
    RunState(commands[0][1]).start()  # this test's process: alive, on this host
    RunState(commands[1][1]).start()
    state = json.loads((commands[1][1] / RUN_FILE).read_text())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    (commands[1][1] / RUN_FILE).write_text(json.dumps({**state, "pid": child.pid}))  # killed outright
    ran: list[str] = []
    lines: list[str] = []
    outcome = run_sweep(commands, run=lambda c: ran.append(c[0]) or 0, say=lines.append)
    assert ran == ["loss.name=pnp", "loss.name=smoothap"]
    assert outcome.running_elsewhere == [commands[0][1]] and not outcome.failed
    assert f"warning: process {os.getpid()} still trains it, skipped" in lines[0]


def test_a_failed_point_does_not_stop_the_others_a_stopped_one_stops_the_sweep(
    grid: tuple[Path, list],
) -> None:
    out, points = grid
    commands = [(p, point_dir(out, p), [p.name]) for p in points]
    codes = {"loss.name=fastap": 1, "loss.name=pnp": 0, "loss.name=smoothap": 0}
    outcome = run_sweep(commands, run=lambda c: codes[c[0]], say=lambda _: None)
    assert outcome.failed == [commands[0][1]] and not outcome.stopped
    codes["loss.name=fastap"] = 75
    ran: list[str] = []
    outcome = run_sweep(commands, run=lambda c: ran.append(c[0]) or codes[c[0]], say=lambda _: None)
    assert ran == ["loss.name=fastap"] and outcome.stopped


def test_print_gives_one_launch_command_per_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep"
    assert main(["sweep", f"train.output_dir={out}", "data.global_batch_size=64,256", "loss.name=fastap,pnp",
                 "--processes", "2", "--equal", "images", "train.steps=100", "--print"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4
    first, third = shlex.split(lines[0]), shlex.split(lines[2])
    assert "accelerate.commands.launch" in first and "train.resume=auto" in first
    # Decided where it runs, not from this machine's hardware: no CPU launcher file, no port picked here.
    assert "--multi_gpu" in first and "--config_file" not in first and "--main_process_port" not in first

    def steps(command: list[str]) -> int:
        (value,) = [a[12:] for a in command if a.startswith("train.steps=")]  # the derived one only
        return int(value)

    assert steps(first) * 64 == steps(third) * 256  # --equal images: 4x the steps at a quarter of the batch
    assert f"train.output_dir={out / 'data.global_batch_size=64,loss.name=fastap'}" in first
    assert not out.exists()  # printing runs nothing


def test_a_bad_grid_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sweep", f"train.output_dir={tmp_path / 's'}", "loss.name=fastap,pnq"]) == 2
    assert "sweep point loss.name=pnq" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerator_state")
def test_a_real_sweep_of_two_points_ends_with_their_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    train_points_in_this_process(monkeypatch)
    shards = build_tiny_shards(tmp_path / "data")
    out = tmp_path / "sweep"
    config = tmp_path / "base.yaml"  # --equal images counts from the config's batch: 4 steps of 16 images
    config.write_text(
        "data: {global_batch_size: 16}\ntrain: {steps: 4, eval_every: 2, checkpoint_every: 2}\n"
    )
    tiny = [o for o in TINY_OVERRIDES if not o.startswith(("train.eval_every=", "data.global_batch_size="))]
    args = ["sweep", "--config", str(config), f"data.shards={shards}", f"train.output_dir={out}", *tiny,
            "data.global_batch_size=8,16", "--equal", "images"]  # fmt: skip
    assert main(args) == 0
    first = capsys.readouterr().out
    table = (out / "compare.md").read_text()
    assert table in first
    rows = [line for line in table.splitlines() if line.startswith("| data.global_batch_size=")]
    assert len(rows) == 2 and all("| finished |" in row for row in rows)
    assert "| 8 of 8 | 64 |" in rows[0] and "| 4 of 4 | 64 |" in rows[1]  # equal images seen
    assert (out / "compare.png").is_file()
    for name in ("data.global_batch_size=8", "data.global_batch_size=16"):
        assert json.loads((out / name / RUN_FILE).read_text())["status"] == "finished"
    assert main(args) == 0  # again: nothing left to do
    assert capsys.readouterr().out.count("finished already, skipped") == 2


def test_in_process_is_for_one_process_points(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["sweep", "--in-process", "--processes", "2", f"train.output_dir={tmp_path}", "train.seed=1,2"])
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "drop --processes" in err[-1], err


@pytest.mark.slow
def test_an_in_process_sweep_trains_every_point_in_this_process(tmp_path: Path) -> None:
    from accelerate.state import AcceleratorState

    shards = build_tiny_shards(tmp_path / "data")
    out = tmp_path / "sweep"
    tiny = [o for o in TINY_OVERRIDES if not o.startswith("train.steps=")]
    args = ["sweep", "--in-process", f"data.shards={shards}", f"train.output_dir={out}", *tiny, "train.steps=2",
            "train.mixed_precision=bf16,no"]  # fmt: skip
    assert main(args) == 0
    for name in ("train.mixed_precision=bf16", "train.mixed_precision=no"):
        state = json.loads((out / name / RUN_FILE).read_text())
        assert state["status"] == "finished" and state["pid"] == os.getpid()
    assert not AcceleratorState._shared_state  # the process is left as the sweep found it
