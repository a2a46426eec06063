"""``compare`` names every run it leaves out of a picture and why, prints counts as integers, and takes its
default metric from the runs (a verification run's ``roc_auc``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import load_config, save_config
from ddp_rank.train.run_state import RunState
from tests.experiments.test_compare import make_run

pytest.importorskip("matplotlib")


def deployment_run(root: Path, name: str, gallery_size: int = 4, status: str = "finished") -> Path:
    """A run evaluated with eval.protocol=identification and verification beside it, with its curves."""
    import torch

    from ddp_rank.eval.deployment import DeploymentSettings, deployment_metrics

    run = root / name
    cfg = load_config(None, ["eval.protocol=identification", "eval.metrics=[verification]",
                             "train.best_metric=cmc@1", f"train.output_dir={run}", "train.steps=5"])  # fmt: skip
    save_config(cfg, run / "config.yaml")
    e = torch.nn.functional.normalize(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    metrics = deployment_metrics(
        ["identification", "verification"], e, torch.arange(16) // 2, DeploymentSettings()
    )
    curves = metrics.pop("curves")
    metrics["gallery_size"] = gallery_size
    records = [{"kind": "train", "step": 5, "loss": 0.1}, {"kind": "eval", "step": 5, **metrics}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run / "curves.json").write_text(json.dumps({"step 5": curves}))
    state = RunState(run)
    state.start()
    if status == "finished":
        state.finished(5)
    return run


def test_a_run_without_the_curve_is_named_with_why(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    drawn = deployment_run(tmp_path, "with-curves")
    plain = make_run(tmp_path, "recall-only", 64, [0.5])
    cmc_only = deployment_run(tmp_path, "cmc-only")
    saved = json.loads((cmc_only / "curves.json").read_text())
    del saved["step 5"]["roc"]
    (cmc_only / "curves.json").write_text(json.dumps(saved))
    assert main(["compare", str(drawn), str(plain), str(cmc_only), "--curve", "roc"]) == 0
    err = capsys.readouterr().err
    assert (tmp_path / "compare-roc.png").stat().st_size > 1000
    left_out = [line for line in err.splitlines() if "left out of the roc curve" in line]
    assert len(left_out) == 2, err
    assert f"{plain}: no curves.json" in left_out[0] and "eval.protocol=verification" in left_out[0]
    assert f"{cmc_only}: its last evaluation drew cmc, pr, not roc" in left_out[1]
    assert str(drawn) not in "".join(left_out)


def test_a_run_the_plot_leaves_out_is_named_with_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    done = make_run(tmp_path, "bs=64", 64, [0.5, 0.6])
    other = make_run(tmp_path, "bs=128", 128, [0.4])
    running = make_run(tmp_path, "bs=256", 256, [0.3], status="running")
    no_metric = deployment_run(tmp_path, "bs=512")
    args = ["compare", str(done), str(other), str(running), str(no_metric), "--metric", "recall@1"]
    assert main([*args, "--plot", str(tmp_path / "c.png")]) == 0
    err = capsys.readouterr().err
    assert f"left out of the plot: {running}: running, not finished" in err
    assert f"left out of the plot: {no_metric}: no evaluation logged recall@1" in err
    assert str(done) not in err and str(other) not in err


def test_counts_are_integers_and_the_default_metric_is_the_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    a = deployment_run(tmp_path, "a", gallery_size=4)
    b = deployment_run(tmp_path, "b", gallery_size=1200)
    shutil.copy(a / "config.yaml", b / "config.yaml")
    assert main(["compare", str(a), str(b)]) == 0  # no --metric: the runs' train.best_metric, cmc@1
    out = capsys.readouterr().out
    header, _, first, second = out.splitlines()[:4]
    assert "best cmc@1" in header and "last gallery_size" in header
    column = header.split(" | ").index("last gallery_size")
    assert first.split(" | ")[column] == "4" and second.split(" | ")[column] == "1,200"
    assert "400.00" not in out


def test_points_without_replicates_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    make_run(tmp_path, "bs=64", 64, [0.5])
    make_run(tmp_path, "bs=128", 128, [0.4])
    assert main(["compare", str(tmp_path), "--csv", "--points"]) == 0
    assert "--points: no runs differ only in their seeds" in capsys.readouterr().err
