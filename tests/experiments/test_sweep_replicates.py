"""Replicates as a sweep axis: ``--replicates K`` (or an axis over ``train.seed`` / ``data.seed``) trains K runs
per point that differ only in their seeds, named last, run seed by seed, resumed like any sweep's points."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import ConfigError
from ddp_rank.experiments.grid import expand_grid
from ddp_rank.experiments.sweep import point_dir, run_sweep
from ddp_rank.train.run_state import RunState
from tests.experiments.test_sweep import train_points_in_this_process
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


def test_replicates_add_a_seed_axis_named_last_and_run_seed_by_seed(tmp_path: Path) -> None:
    base, points = expand_grid(None, ["loss.name=fastap,pnp", "train.seed=7"], replicates=3)
    assert base.train.seed == 7
    assert [p.name for p in points] == [
        "loss.name=fastap,train.seed=7", "loss.name=pnp,train.seed=7",
        "loss.name=fastap,train.seed=8", "loss.name=pnp,train.seed=8",
        "loss.name=fastap,train.seed=9", "loss.name=pnp,train.seed=9",
    ]  # fmt: skip
    assert [(p.config.loss.name, p.config.train.seed) for p in points[:2]] == [("fastap", 7), ("pnp", 7)]
    assert all(p.config.data.seed == -1 for p in points)  # the data follows train.seed


def test_a_seed_axis_given_by_hand_is_a_replicate_axis(tmp_path: Path) -> None:
    _, points = expand_grid(None, ["data.seed=0,1", "data.sampler=hard,random", "train.seed=3"])
    assert [p.name for p in points] == [
        "data.sampler=hard,data.seed=0", "data.sampler=random,data.seed=0",
        "data.sampler=hard,data.seed=1", "data.sampler=random,data.seed=1",
    ]  # fmt: skip
    assert {p.config.train.seed for p in points} == {3}  # the initial weights stay fixed
    _, alone = expand_grid(None, ["train.steps=5"], replicates=2)  # seeds only: one point, two runs
    assert [p.name for p in alone] == ["train.seed=0", "train.seed=1"]


def test_replicates_beside_a_seed_axis_or_below_one_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match=r"--replicates and a train\.seed axis"):
        expand_grid(None, ["train.seed=0,1"], replicates=2)
    with pytest.raises(ConfigError, match="--replicates -1"):
        expand_grid(None, ["loss.name=fastap,pnp"], replicates=-1)
    assert main(["sweep", f"train.output_dir={tmp_path}", "train.seed=0,1", "--replicates", "3"]) == 2
    assert "ddp-rank sweep: error: --replicates and a train.seed axis" in capsys.readouterr().err


def test_replicates_resume_finished_seeds_skipped_the_others_continued(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    _, points = expand_grid(None, ["loss.name=fastap,pnp", f"train.output_dir={out}"], replicates=2)
    commands = [(p, point_dir(out, p), [p.name]) for p in points]
    for _, folder, _ in commands[:2]:  # seed 0 of both points finished before the sweep was cut
        state = RunState(folder)
        state.start()
        state.finished(10)
    stopped = RunState(commands[2][1])
    stopped.start()
    stopped.stopped(4)
    ran: list[str] = []
    lines: list[str] = []
    outcome = run_sweep(commands, run=lambda c: ran.append(c[0]) or 0, say=lines.append)
    assert ran == ["loss.name=fastap,train.seed=1", "loss.name=pnp,train.seed=1"]
    assert [outcome.done[f] for _, f, _ in commands] == ["skipped", "skipped", "finished", "finished"]
    assert "continuing a stopped run" in lines[2]


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_accelerator_state")
def test_a_real_sweep_of_replicates_ends_with_their_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    train_points_in_this_process(monkeypatch)
    shards = build_tiny_shards(tmp_path / "data")
    out = tmp_path / "sweep"
    tiny = [o for o in TINY_OVERRIDES if not o.startswith("train.eval_every=")]
    args = ["sweep", f"data.shards={shards}", f"train.output_dir={out}", *tiny, "train.steps=2",
            "train.eval_every=2", "--replicates", "2"]  # fmt: skip
    assert main(args) == 0
    table = (out / "compare.md").read_text()
    assert table in capsys.readouterr().out
    assert "| all runs | 2 of 2 |" in table and "(n=2)" in table
    assert (out / "compare.png").is_file()
    assert main(args) == 0  # again: both seeds finished, nothing to train
    assert capsys.readouterr().out.count("finished already, skipped") == 2
