"""benchmarks/study_features.py: the rules the word study states (every choice on validation, the test split once
per final run, the same candidates and schedule shape at every batch), on a simulated trainer; and its record ->
table, conclusions and plot."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import benchmarks.study_features as study
from benchmarks.study_features_report import optimum, plots, summary
from benchmarks.study_features_runs import Schedule, check_same_settings
from ddp_rank.config import load_config, save_config
from ddp_rank.data.features.synthetic import write_feature_shards
from ddp_rank.data.format.manifest import Manifest


def test_every_batch_gets_the_same_epochs_warm_up_share_and_a_decay_to_zero() -> None:
    schedule = Schedule(epochs=8, warmup=0.05, evals=8)
    for batch in (64, 1024, 8192):
        steps, overrides = schedule.overrides(batch, n_train=150_000)
        settings = dict(o.split("=", 1) for o in overrides)
        assert steps == math.ceil(8 * 150_000 / batch) == int(settings["train.steps"])
        assert settings["optim.schedule"] == "cosine" and float(settings["optim.min_lr_ratio"]) == 0
        assert int(settings["optim.warmup_steps"]) == max(1, round(0.05 * steps))
        assert steps // int(settings["train.eval_every"]) >= 8, "fewer evaluations than asked along the run"


N_TRAIN = 512
"""Training images of the simulated study's shards: every batch's epoch a whole number of steps."""


class _Simulated:
    """``Trainer.train`` and ``Trainer.test`` without training. Validation R@1 at the end of a run is
    ``ceiling * (1 - exp(-epochs / tau))`` plus 0.001 per seed: the ceiling peaks at 9 x 1e-3 x sqrt(B / 1024) (one
    step above the probe's rate, so the sweep must grow) and at batch 64; tau is 0.5 epoch at batch 64, 1 at 128 and
    2 at 256 (the largest batch takes longest). Rates above 27 x the scale diverge. On the test words every point
    scores the same but batch 128, which scores higher there: a study that chose on the test words would pick 128."""

    def __init__(self) -> None:
        self.trained: dict[str, list[str]] = {}
        self.calls: list[str] = []
        self.tested: list[str] = []

    def value(self, settings: dict[str, str], n_train: int) -> float:
        batch, lr = int(settings["data.global_batch_size"]), float(settings["optim.lr"])
        best_rate = 9e-3 * math.sqrt(batch / 1024)
        ceiling = 0.8 - 0.05 * abs(math.log(lr / best_rate, 3)) - 0.01 * math.log2(batch / 64)
        epochs = int(settings["train.steps"]) * batch / n_train
        tau = {64: 0.5, 128: 1.0, 256: 2.0}[batch]
        return ceiling * (1 - math.exp(-epochs / tau)) + 0.001 * int(settings["train.seed"])

    def train(
        self, trainer: study.Trainer, run: Path, overrides: list[str], steps: int, may_fail: bool = False
    ) -> bool:
        settings = dict(o.split("=", 1) for o in [*trainer.common, *overrides])
        self.calls.append(str(run))
        self.trained[str(run)] = [*trainer.common, *overrides]
        scale = 1e-3 * math.sqrt(int(settings["data.global_batch_size"]) / 1024)
        if float(settings["optim.lr"]) > 30 * scale:
            assert may_fail, "only a candidate rate may diverge"
            return False
        every = int(settings["train.eval_every"])
        run.mkdir(parents=True, exist_ok=True)
        final = self.value(settings, N_TRAIN)
        evaluated = sorted({*range(every, steps + 1, every), steps})
        lines = [json.dumps({"kind": "eval", "step": s, "recall@1": final * s / steps, "recall@10": 0.9,
                             "map@r": 0.4}) for s in evaluated]  # fmt: skip
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run / "settings.json").write_text(json.dumps(settings))
        return True

    def test(self, trainer: study.Trainer, run: Path) -> None:
        settings = json.loads((run / "settings.json").read_text())
        seed = int(settings.get("train.seed", 0))
        rng = np.random.default_rng(seed)
        labels = np.repeat(np.arange(100), 4)
        rate = 0.7 + (0.1 if settings["data.global_batch_size"] == "128" else 0.0)
        hits = (rng.random(400) < rate).astype(np.float64)
        np.savez(run / "test-queries.npz", **{"recall@1": hits, "recall@10": np.ones(400), "map@r": hits / 2,
                                               "label": labels, "key": np.array([f"q{i}" for i in range(400)])})  # fmt: skip
        metrics = {"recall@1": hits.mean(), "recall@10": 1.0, "map@r": hits.mean() / 2}
        (run / "test.json").write_text(json.dumps({"test": {"metrics": metrics}}))
        self.tested.append(str(run))


@pytest.fixture
def simulated_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, _Simulated, Path]:
    shards = write_feature_shards(
        tmp_path / "shards", [32, 32, 32, 32], images=8, dim=4, test_every=4, val_every=4
    )
    assert Manifest.load(shards).splits["train"].samples == N_TRAIN
    simulated = _Simulated()
    monkeypatch.setattr(study.Trainer, "train", lambda trainer, *args: simulated.train(trainer, *args))
    monkeypatch.setattr(study.Trainer, "test", lambda trainer, run: simulated.test(trainer, run))
    monkeypatch.setattr(study, "plots", lambda record, out: [])  # drawn once, by its own test
    out = tmp_path / "study"
    args = [
        "--shards",
        str(shards),
        "--out",
        str(out),
        "--batches",
        "64,128,256",
        "--probe-epochs",
        "1",
        "--evals",
        "2",
    ]
    assert study.main(args) == 0
    return json.loads((out / "study.json").read_text()), simulated, out


def test_the_length_probe_doubles_until_a_doubling_gains_less_than_its_threshold(
    simulated_study: tuple[dict, _Simulated, Path],
) -> None:
    record, _, _ = simulated_study
    rows = {(r["batch"], r["epochs"]): r for r in record["probe"]}
    # the smallest, the geometric middle and the largest batch, two seeds each
    assert record["rule"]["probe_batches"] == [64, 128, 256]
    # tau = 2 epochs at 256: gains of 17.4, 17.0, 8.6, 1.3 points, then 0.02 < 0.2 from 16 to 32 epochs
    assert [e for b, e in rows if b == 256] == [1, 2, 4, 8, 16]
    assert [rows[256, e]["stopped"] for e in (1, 2, 4, 8, 16)] == [False] * 4 + [True]
    # at the probe rate (a step below the best: -0.05) and batch 256 (-0.02) the ceiling is 0.73
    assert rows[256, 8]["gain"] == pytest.approx(73 * (math.exp(-4) - math.exp(-8)))
    # the seeds differ by 0.1 points: the threshold is the 0.2-point floor
    assert all(r["spread"] == pytest.approx(0.1, abs=1e-6) and r["threshold"] == 0.2 for r in record["probe"])
    # tau = 0.5 at 64: 2 to 4 epochs gains 1.35, 4 to 8 0.03: stopped at 4; one length for all, the longest
    assert max(e for b, e in rows if b == 64) == 4 and rows[64, 4]["stopped"]
    assert record["rule"]["epochs"] == 16
    for point in record["points"]:
        assert point["epochs"] == pytest.approx(16, rel=0.1), "every final run trains the probe's length"


def test_the_rate_is_swept_at_the_final_length_until_the_winner_is_interior(
    simulated_study: tuple[dict, _Simulated, Path],
) -> None:
    record, simulated, out = simulated_study
    for point in record["points"]:
        scale = 1e-3 * math.sqrt(point["batch"] / 1024)
        # 1, 3, 9 x the scale first; 9 wins at the top, so 27 is tried; 9 is then interior
        assert [float(r) for r in point["sweep"]] == pytest.approx(
            [scale * f for f in (1, 3, 9, 27)], rel=2e-3
        )
        assert point["lr"] == pytest.approx(9 * scale, rel=2e-3) and not point["at_edge"]
        for lr in point["sweep"]:
            run = out / "runs" / f"batch={point['batch']},lr={float(lr):.3g},epochs=16,seed=0"
            assert str(run) in simulated.trained
    # every run trained once: the probe's 16-epoch run at 256 is also that batch's candidate at the probe's rate
    assert len(simulated.calls) == len(set(simulated.calls)) == record["runs_trained"]


def test_every_choice_is_made_on_validation_and_the_test_split_is_read_once_per_final_run(
    simulated_study: tuple[dict, _Simulated, Path],
) -> None:
    record, simulated, out = simulated_study
    points = {p["batch"]: p for p in record["points"]}
    for overrides in simulated.trained.values():
        assert "data.test_split=val" in overrides and "data.train_split=train" in overrides
    finals = sorted(str(out / r["path"]) for p in record["points"] for r in p["runs"])
    assert sorted(simulated.tested) == finals and len(finals) == 3 * 3
    assert all(f",lr={points[int(f.split('batch=')[1].split(',')[0])]['lr']:.3g}," in f for f in finals)
    # the best batch by validation (64), not by the test words (128 scores higher there)
    assert record["best_batch"] == 64
    assert points[128]["runs"][0]["test"]["recall@1"] > points[64]["runs"][0]["test"]["recall@1"]
    assert record["validation"]["val_fraction"] is None  # synthetic feature shards come from no image build


def test_intervals_are_recomputed_from_the_kept_queries_and_the_table_from_the_record(
    simulated_study: tuple[dict, _Simulated, Path],
) -> None:
    record, _, out = simulated_study
    rows = {(r["a"], r["b"]): r for r in record["differences"]}
    assert set(rows) == {(128, 64), (256, 128), (256, 64)}
    r1 = rows[(128, 64)]["recall@1"]
    low, high, df = r1["combined"]
    assert low <= r1["mean"] <= high and df >= 2 and r1["verdict"] == "higher"
    assert record["multiplicity"] == {"differences": 3, "per_metric_confidence": pytest.approx(1 - 0.05 / 3)}
    assert all(p["interval"]["recall@1"][0] < p["interval"]["recall@1"][1] for p in record["points"])
    with np.load(out / "queries.npz") as kept:
        assert len(kept["label"]) == 400 and "batch=128,seed=2,map@r" in kept.files
    text = (out / "study.md").read_text()
    assert "Chosen on the validation words: batch 64" in text
    assert (
        "Beyond noise ABOVE the chosen batch (validation and test disagree) on test R@1 (points): 128" in text
    )
    assert "**Every final run trains 16 epochs.**" in text
    saved = json.loads((out / "study.json").read_text())
    for point in saved["points"]:
        del point["interval"]
    del saved["differences"]
    (out / "study.json").write_text(json.dumps(saved))
    (out / "study.md").unlink()
    assert study.main(["--from-record", str(out / "study.json"), "--out", str(out)]) == 0
    assert (out / "study.md").read_text() == text
    # the layout --results writes: the record and its queries under dated names, outputs elsewhere
    results = out.parent / "results"
    results.mkdir()
    (results / "study-features-2026-01-01.json").write_text(json.dumps(saved))
    (out / "queries.npz").rename(results / "study-features-2026-01-01-queries.npz")
    again = out.parent / "again"
    assert (
        study.main(["--from-record", str(results / "study-features-2026-01-01.json"), "--out", str(again)])
        == 0
    )
    assert (again / "study.md").read_text() == text and sorted(p.name for p in results.iterdir()) == [
        "study-features-2026-01-01-queries.npz",
        "study-features-2026-01-01.json",
    ]


def test_the_plot_draws_the_intervals_the_probe_and_the_curves(
    simulated_study: tuple[dict, _Simulated, Path], tmp_path: Path
) -> None:
    record, _, _ = simulated_study
    (path,) = plots(record, tmp_path)
    assert path.stat().st_size > 10_000


def test_where_the_optimum_lies_is_read_from_the_family_wise_steps_around_the_highest_test_mean() -> None:
    def record(means: dict[int, float], steps: list[str]) -> dict:
        points = [{"batch": b, "runs": [{"test": {"recall@1": m / 100}}]} for b, m in means.items()]
        batches = sorted(means)
        # each step stored as the larger batch minus the smaller, but the first the other way round
        rows = [
            {
                "a": lo,
                "b": hi,
                "recall@1": {
                    "mean": 0.0,
                    "verdict": None,
                    "bonferroni": {"higher": "lower", "lower": "higher"}.get(v, v),
                },
            }
            if k == 0
            else {"a": hi, "b": lo, "recall@1": {"bonferroni": v}}
            for k, (lo, hi, v) in enumerate(zip(batches[:-1], batches[1:], steps, strict=True))
        ]
        return {"best_batch": batches[0], "points": points, "differences": rows}

    means = {64: 78.2, 256: 79.2, 1024: 78.8, 2048: 78.2, 4096: 77.0}
    peaked = record(means, ["higher", "within noise", "within noise", "lower"])
    assert optimum(peaked) == (
        "the optimum lies between 64 and 4,096 exclusive (test R@1 is highest at 256; 256 to 2,048 cannot be told "
        "apart step by step)"
    )
    assert optimum(record(means, ["within noise", "lower", "within noise", "lower"])) == (
        "the optimum cannot be located: the batches that cannot be told apart from the highest test R@1 (256) step "
        "by step, 64 to 256, reach the smallest batch of the range"
    )
    peaked["rule"] = {"epochs": 16}
    assert summary(peaked).startswith(
        "The word study at one equal length (16 epochs, from its length probe), every choice on validation words: "
        "test R@1 78.2 at 64 (chosen on validation), 79.2 at 256 (highest), 77.0 at 4,096; by the family-wise"
    )


def test_a_probe_cap_the_doublings_cannot_reach_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        study.main(["--probe-epochs", "4", "--max-epochs", "50"])
    assert "--max-epochs 50 must be --probe-epochs 4 doubled one or more times" in capsys.readouterr().err


def test_shards_without_a_validation_split_are_refused_with_the_fix(tmp_path: Path) -> None:
    shards = write_feature_shards(tmp_path / "shards", [6, 6], images=4, dim=4)
    with pytest.raises(SystemExit, match=r"no split 'val'.*--val-fraction 0.1"):
        study.main(["--shards", str(shards), "--out", str(tmp_path / "out")])


def test_a_run_trained_with_other_settings_is_never_reused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    save_config(
        load_config(None, ["optim.lr=0.001", "train.steps=100", "eval.metrics=[]"]), run / "config.yaml"
    )
    # The overrides are read as `ddp-rank train` reads them: 1e-3 is the rate saved as 0.001, [] the empty list.
    check_same_settings(run, ["optim.lr=1e-3", "train.steps=100", "eval.metrics=[]"])
    with pytest.raises(
        SystemExit, match=r"other settings \(train.steps=100, asked 200\).*give another --out"
    ):
        check_same_settings(run, ["optim.lr=1e-3", "train.steps=200"])
    with pytest.raises(SystemExit, match=r"other settings \(optim.lr=0.001, asked 0.003\)"):
        check_same_settings(run, ["optim.lr=3e-3"])
    with pytest.raises(SystemExit, match=r"cannot be compared with the settings asked.*optim.lrr"):
        check_same_settings(run, ["optim.lrr=3e-3"])


def test_a_probe_of_one_seed_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        study.main(["--probe-seeds", "1"])
    assert "--probe-seeds must be at least 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        study.main(["--batches", "64,256", "--probe-batches", "128"])
    assert "--probe-batches [128]: each must be one of --batches [64, 256]" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_train_in_worker_processes_jobs_at_a_time(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ddp_rank.experiments.runs import read_run

    shards = write_feature_shards(tmp_path / "shards", [6, 6, 6], images=6, dim=8, test_every=3, val_every=3)
    out = tmp_path / "study"
    trainer = study.Trainer(study._parse(["--shards", str(shards), "--out", str(out), "--jobs", "2"]), out)
    runs = [out / "runs" / f"run{i}" for i in range(2)]
    overrides = ["data.global_batch_size=12", "model.embedding_dim=8", "train.steps=2", "train.eval_every=2"]
    try:
        with ThreadPoolExecutor(2) as threads:
            trained = list(threads.map(lambda run: trainer.train(run, overrides, 2), runs))
        assert trainer.train(runs[0], overrides, 2)  # finished with these settings: kept, not trained again
    finally:
        trainer.close()
    assert trained == [True, True]
    for run in runs:
        summary = read_run(run)
        assert summary.status == "finished" and summary.steps == 2 and summary.last("recall@1") is not None
        assert not list(run.glob("*.png"))  # the study draws its own pictures
        log = (run.parent / f"{run.name}.train.log").read_text()
        assert "step 2/2" in log and f"done: 2 steps, outputs in {run}" in log
    pids = {json.loads((run / "run.json").read_text())["pid"] for run in runs}
    assert len(pids) == 2 and os.getpid() not in pids  # two worker processes, one run each at a time
