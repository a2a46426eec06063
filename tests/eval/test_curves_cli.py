"""The verification / identification figures where a user meets them: a training run's metrics.jsonl, summary
and curve pictures, ``ddp-rank eval --output`` and ``ddp-rank compare --curve``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.config import ConfigError, load_config
from ddp_rank.train.run_outputs import read_metrics
from ddp_rank.train.trainer import run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


@pytest.fixture(scope="module", autouse=True)
def _matplotlib() -> None:
    """Imported when this file's tests run, not by every worker that collects the suite; without it the file
    is skipped."""
    pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step tiny_cnn run evaluated with Recall@k and both groups of deployment figures beside it, its best
    checkpoint chosen by a figure the test split cannot measure (240 negative pairs for TPR@FPR=1e-4). The
    direct step (no chunk trial): the figures do not depend on it."""
    tmp = tmp_path_factory.mktemp("run")
    out = tmp / "run"
    run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={build_tiny_shards(tmp)}",
                                    f"train.output_dir={out}", "train.steps=2", "distributed.chunk_size=0",
                                    "eval.metrics=[verification,identification]",
                                    "train.best_metric=tpr@fpr=1e-4"]))  # fmt: skip
    return out


def test_the_run_logs_the_figures_and_draws_the_curves(run_dir: Path) -> None:
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals and all("roc_auc" in r and "cmc@1" in r and "recall@1" in r for r in evals)
    assert "curves" not in evals[-1]  # the curves go to curves.json, not into the log
    assert (
        "tpr@fpr=1e-4" in evals[-1] and evals[-1]["tpr@fpr=1e-4"] is None
    )  # 240 negative pairs: not measurable
    for picture in ("roc.png", "det.png", "pr.png", "cmc.png"):
        assert (run_dir / picture).stat().st_size > 1000, picture
    summary = (run_dir / "summary.md").read_text()
    assert "**verification**: TPR@FPR=1e-2" in summary and "TPR@FPR=1e-4 not measurable" in summary
    assert "**identification**: CMC@1" in summary and "gallery" in summary
    assert "![roc](roc.png)" in summary
    assert "**best**" not in summary  # the best-checkpoint figure was not measurable: no best, no crash
    assert list(json.loads((run_dir / "curves.json").read_text())) == [f"step {r['step']}" for r in evals]


def test_eval_output_draws_every_entry_and_prints_the_figures(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "results.json"
    for args in (["--baseline", "untrained"], ["--checkpoint", str(run_dir)]):
        code = main(["eval", "--config", str(run_dir / "config.yaml"), *args, "--output", str(out),
                     "eval.protocol=verification", "eval.metrics=[]"])  # fmt: skip
        assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "verification: TPR@FPR=1e-2" in printed and "results-roc.png" in printed
    entries = json.loads(out.read_text())
    assert len(entries) == 2 and all(
        "roc" in e["curves"] and "roc_auc" in e["metrics"] for e in entries.values()
    )
    for picture in ("roc", "det", "pr"):
        assert (tmp_path / f"results-{picture}.png").is_file()
    assert not (tmp_path / "results-cmc.png").exists()  # no identification asked


def test_compare_draws_runs_on_one_figure(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    picture = tmp_path / "both.png"
    assert main(["compare", str(run_dir), str(other), "--curve", "det", "--curve-output", str(picture)]) == 0
    assert picture.stat().st_size > 1000 and "det curve:" in capsys.readouterr().err
    (other / "curves.json").unlink()
    kept = (run_dir / "curves.json").read_text()
    saved = json.loads(kept)
    del saved[list(saved)[-1]]["cmc"]
    (run_dir / "curves.json").write_text(json.dumps(saved))
    try:
        assert (
            main(["compare", str(run_dir), str(other), "--curve", "cmc", "--curve-output", str(picture)]) == 2
        )
        assert "no run has a cmc curve" in capsys.readouterr().err
    finally:
        (run_dir / "curves.json").write_text(kept)


def test_settings_are_checked_at_start_up() -> None:
    with pytest.raises(
        ConfigError, match=r"eval\.metrics=verification is not available with eval\.protocol=vehicleid"
    ):
        load_config(None, ["eval.protocol=vehicleid", "eval.metrics=[verification]"])
    with pytest.raises(ConfigError, match=r"eval\.enrolled_fraction"):
        load_config(None, ["eval.enrolled_fraction=0"])
    with pytest.raises(ConfigError, match=r"eval\.fprs"):
        load_config(None, ["eval.fprs=[0.01,2]"])


def test_best_metric_is_checked_against_the_deployment_figures() -> None:
    from ddp_rank.eval.settings import check_evaluation, evaluation_settings

    cfg = load_config(None, ["eval.protocol=verification"])  # best_metric stays recall@1: not reported
    with pytest.raises(
        ConfigError, match=r"valid: tpr@fpr=1e-2, tpr@fpr=1e-3, tpr@fpr=1e-4, roc_auc, eer, pr_auc$"
    ):
        check_evaluation(evaluation_settings(cfg), cfg.train.best_metric, None)  # type: ignore[arg-type]  # the manifest is read for VehicleID only
    cfg = load_config(None, ["eval.metrics=[identification]", "train.best_metric=cmc@1"])
    check_evaluation(evaluation_settings(cfg), cfg.train.best_metric, None)  # type: ignore[arg-type]


def test_a_perfect_separation_is_drawn_too(tmp_path: Path) -> None:
    """Every positive pair above every negative one: FNR 0 from the lowest FPR on, drawn at the DET floor."""
    import numpy as np

    from ddp_rank.eval.curves import draw_curves
    from ddp_rank.eval.verification import verification_metrics

    y = np.repeat(np.arange(5), 3)
    metrics, curves = verification_metrics(np.eye(5, dtype=np.float32)[y], y)
    assert metrics["roc_auc"] == 1.0 and metrics["eer"] == 0.0
    drawn = draw_curves({"perfect": curves}, tmp_path)
    assert [p.name for p in drawn] == ["roc.png", "det.png", "pr.png"]
