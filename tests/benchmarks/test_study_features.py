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
from benchmarks.study_features import Schedule, _categories_to_fill, _val_gain
from ddp_rank.config import load_config, save_config
from ddp_rank.data.format.manifest import ClassInfo, Manifest, SplitInfo
from ddp_rank.experiments.runs import RunSummary
from ddp_rank.features.synthetic import write_feature_shards


def _manifest(category_images: list[int]) -> Manifest:
    """One class of ``n`` images per category."""
    classes = tuple(ClassInfo(i, f"c{i}", i) for i in range(len(category_images)))
    counts = dict(enumerate(category_images))
    split = SplitInfo("train", counts, ())
    return Manifest(tuple(f"k{i}" for i in range(len(category_images))), classes, {"train": split})


def test_hard_categories_per_batch_keep_nine_tenths_of_the_images() -> None:
    manifest = _manifest([1000, 1000, 500, 100])  # 2,600 images
    # batch 400, k = 2: shares of 200; the categories of 1000, 1000, 500 hold 2,500 >= 0.9 * 2,600
    assert _categories_to_fill(manifest, "train", 400) == 2
    # batch 2,000, k = 2: shares of 1,000: 2,000 < 2,340; k = 3: 667: still 2,000; k = 4: 500: 2,500
    assert _categories_to_fill(manifest, "train", 2000) == 4
    assert _categories_to_fill(manifest, "train", 100_000) == 4
    assert _categories_to_fill(_manifest([10_000, 10, 10]), "train", 8, coverage=0.5) == 2


def test_every_batch_gets_the_same_epochs_warm_up_share_and_a_decay_to_zero() -> None:
    schedule = Schedule(epochs=8, warmup=0.05, evals=8)
    for batch in (64, 1024, 8192):
        steps, overrides = schedule.overrides(batch, n_train=150_000)
        settings = dict(o.split("=", 1) for o in overrides)
        assert steps == math.ceil(8 * 150_000 / batch) == int(settings["train.steps"])
        assert settings["optim.schedule"] == "cosine" and float(settings["optim.min_lr_ratio"]) == 0
        assert int(settings["optim.warmup_steps"]) == max(1, round(0.05 * steps))
        assert steps // int(settings["train.eval_every"]) >= 8, "fewer evaluations than asked along the run"


def test_the_gain_over_the_last_quarter() -> None:
    run = RunSummary(path=Path("run"), status="finished")
    run.evals = [{"step": s, "recall@1": v} for s, v in [(25, 0.4), (50, 0.5), (75, 0.600), (100, 0.604)]]
    assert _val_gain(run) == pytest.approx(0.4)
    run.evals = run.evals[-1:]
    assert _val_gain(run) is None


class _Simulated:
    """``Trainer.train`` and ``Trainer.test`` without training. Validation R@1 of a run follows
    ``ceiling * (1 - exp(-step / 20))``, the ceiling peaking at a rate of 1e-3 (PNP: 9e-3) and at batch 64; on the
    test words every point scores the same but batch 128, which scores higher there: a study that chose on the
    test words would pick 128."""

    def __init__(self) -> None:
        self.trained: dict[str, list[str]] = {}
        self.tested: list[str] = []

    def ceiling(self, settings: dict[str, str]) -> float:
        best_rate = 9e-3 if settings.get("loss.name") == "pnp" else 1e-3
        batch = int(settings["data.global_batch_size"])
        return (
            0.8
            - 0.05 * abs(math.log(float(settings["optim.lr"]) / best_rate, 3))
            - 0.01 * math.log2(batch / 64)
        )

    def train(
        self, trainer: study.Trainer, run: Path, overrides: list[str], steps: int, may_fail: bool = False
    ) -> bool:
        settings = dict(o.split("=", 1) for o in [*trainer.common, *overrides])
        if may_fail and float(settings["optim.lr"]) > 0.006:  # the largest candidates diverge
            self.trained[str(run)] = [*trainer.common, *overrides]
            return False
        every = int(settings["train.eval_every"])
        run.mkdir(parents=True, exist_ok=True)
        evaluated = sorted({*range(every, steps + 1, every), steps})
        lines = [json.dumps({"kind": "eval", "step": s, "recall@1": self.ceiling(settings) * (1 - math.exp(-s / 20)),
                             "recall@10": 0.9, "map@r": 0.4}) for s in evaluated]  # fmt: skip
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (run / "settings.json").write_text(json.dumps(settings))
        self.trained[str(run)] = [*trainer.common, *overrides]
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
        tmp_path / "shards", [20, 20, 20], images=8, dim=4, test_every=4, val_every=4
    )
    simulated = _Simulated()
    monkeypatch.setattr(study.Trainer, "train", lambda trainer, *args: simulated.train(trainer, *args))
    monkeypatch.setattr(study.Trainer, "test", lambda trainer, run: simulated.test(trainer, run))
    monkeypatch.setattr(study, "plots", lambda record, out: [])
    out = tmp_path / "study"
    args = ["--shards", str(shards), "--out", str(out), "--batches", "64,128,256", "--epochs", "40",
            "--sweep-epochs", "10", "--variants", "pnp-dq,hard", "--budget-factors", "2,4"]  # fmt: skip
    assert study.main(args) == 0
    return json.loads((out / "study.json").read_text()), simulated, out


def test_every_choice_is_made_on_validation_and_the_test_split_is_read_once_per_final_run(
    simulated_study: tuple[dict, _Simulated, Path],
) -> None:
    record, simulated, out = simulated_study
    points = {p["name"]: p for p in record["points"]}
    assert set(points) == {"64", "128", "256", "pnp-dq", "hard"}
    # every run, sweep or final, evaluates on the validation split during training
    for overrides in simulated.trained.values():
        assert "data.test_split=val" in overrides and "data.train_split=train" in overrides
    # the test split: once per final run, never for a candidate rate
    finals = [r for r in simulated.trained if "/final/" in r]
    assert all(",lr=" in r for r in simulated.trained), (
        "a run's folder names its rate: no rerun reuses another's"
    )
    assert sorted(simulated.tested) == sorted(finals) and len(finals) == 5 * 3
    # the best batch by validation (64), not by the test words (128 scores higher there)
    assert record["best_batch"] == 64
    assert points["128"]["runs"][0]["test"]["recall@1"] > points["64"]["runs"][0]["test"]["recall@1"]
    # the same four candidates around lr0 * sqrt(B / 1024) at every batch; the best validation rate wins
    for name, batch in (("64", 64), ("128", 128), ("256", 256)):
        centre = 1e-3 * math.sqrt(batch / 1024)
        assert list(points[name]["sweep"]) == [f"{centre * f:.3g}" for f in (1, 3, 9, 27)]
        assert points[name]["lr"] == pytest.approx(
            float(max(points[name]["sweep"], key=points[name]["sweep"].get))
        )
    # the variants try the best batch's candidates
    assert points["pnp-dq"]["batch"] == 64 and list(points["pnp-dq"]["sweep"]) == list(points["64"]["sweep"])
    assert not points["pnp-dq"]["at_edge"], "the rate above the chosen one was tried (it diverged)"
    hard = simulated.trained[str(out / "final" / f"sampler=hard,lr={points['hard']['lr']:.3g},seed=0")]
    assert "data.sampler=hard" in hard and any(o.startswith("data.categories_per_batch=") for o in hard)
    assert record["validation"]["val_fraction"] is None  # synthetic feature shards come from no image build
    # PNP's largest candidate, 6.75e-3, "diverges": counted as the worst, the study goes on
    assert math.isnan(points["pnp-dq"]["sweep"]["0.00675"]) and points["pnp-dq"]["lr"] == pytest.approx(
        2.25e-3
    )
    # the budget check: seed 0 of the largest batch (the fewest steps) again for twice and four times the epochs
    checks = {(c["batch"], c["epochs"]): c for c in record["budget_check"]}
    assert sorted(checks) == [(256, 80), (256, 160)]
    assert all(str(out / c["path"]) in simulated.trained for c in checks.values())
    # the simulated curve, 1 - exp(-step / 20), still rises after 40 epochs (12 steps), less after 80
    gains = [checks[256, 80]["gain"], checks[256, 160]["gain"] - checks[256, 80]["gain"]]
    assert gains[0] > gains[1] > 0
    assert checks[256, 160]["val"] == pytest.approx(_last_eval(out / checks[256, 160]["path"]))
    text = (out / "study.md").read_text()
    assert (
        f"Budget check, batch 256, seed 0: validation R@1 at the end of each longer schedule, against the one before "
        f"(40 epochs first): 80 epochs {100 * checks[256, 80]['val']:.2f}, {gains[0]:+.2f}" in text
    )


def _last_eval(run: Path) -> float:
    return float(json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["recall@1"])


def test_differences_carry_both_intervals_and_the_table_is_rewritten_from_the_record(
    simulated_study: tuple[dict, _Simulated, Path],
) -> None:
    record, _, out = simulated_study
    rows = {(r["a"], r["b"]): r for r in record["differences"]}
    assert len(rows) == len(record["differences"]), "a difference reported twice"
    # adjacent batches, each batch against the best, each variant against FastAP random at the best batch
    assert set(rows) == {("batch 128", "batch 64"), ("batch 256", "batch 128"), ("batch 256", "batch 64"),
                         ("pnp-dq", "batch 64"), ("hard", "batch 64")}  # fmt: skip
    r1 = rows[("batch 128", "batch 64")]["recall@1"]
    assert r1["classes"][0] <= r1["mean"] <= r1["classes"][1] and r1["seeds"] is not None
    # same seeds give the same per-query noise to every point: the difference is the 10-point shift, beyond noise
    assert r1["verdict"] == "higher" and r1["classes"][0] > 0
    assert rows[("pnp-dq", "batch 64")]["recall@1"]["verdict"] == "within noise"
    text = (out / "study.md").read_text()
    assert (
        "## Conclusions (written from the record)" in text
        and "Chosen on the validation words: batch 64" in text
    )
    assert (
        "Beyond noise ABOVE the chosen batch (validation and test disagree) on test R@1 (points): 128" in text
    )
    (out / "study.md").unlink()
    assert study.main(["--from-record", str(out / "study.json")]) == 0
    assert (out / "study.md").read_text() == text


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
    study._check_same_settings(run, ["optim.lr=1e-3", "train.steps=100", "eval.metrics=[]"])
    with pytest.raises(
        SystemExit, match=r"other settings \(train.steps=100, asked 200\).*give another --out"
    ):
        study._check_same_settings(run, ["optim.lr=1e-3", "train.steps=200"])
    with pytest.raises(SystemExit, match=r"other settings \(optim.lr=0.001, asked 0.003\)"):
        study._check_same_settings(run, ["optim.lr=3e-3"])
    with pytest.raises(SystemExit, match=r"cannot be compared with the settings asked.*optim.lrr"):
        study._check_same_settings(run, ["optim.lrr=3e-3"])


def test_a_budget_check_no_longer_than_the_final_runs_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        study.main(["--budget-factors", "2,1"])
    assert "--budget-factors [2.0, 1.0]: each must be above 1" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_train_in_worker_processes_jobs_at_a_time(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ddp_rank.experiments.runs import read_run

    shards = write_feature_shards(tmp_path / "shards", [6, 6, 6], images=6, dim=8, test_every=3, val_every=3)
    out = tmp_path / "study"
    trainer = study.Trainer(study._parse(["--shards", str(shards), "--out", str(out), "--jobs", "2"]), out)
    runs = [out / "lr" / f"run{i}" for i in range(2)]
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
