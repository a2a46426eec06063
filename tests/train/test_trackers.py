"""Experiment trackers through accelerate (``train.log_with``): what a run logged is read back from the tracker's
own files, TensorBoard's event files and an MLflow file store, and compared with ``metrics.jsonl`` and the PNGs."""

from __future__ import annotations

import importlib.util
import io
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from ddp_rank.config import ConfigError, load_config
from ddp_rank.runtime import TrainError, make_accelerator
from ddp_rank.train.run_outputs import read_metrics
from ddp_rank.train.trackers import log_picture, tracker_arguments, tracker_key
from ddp_rank.train.trainer import Trainer, run_training
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

STEPS = 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("trackers"))


def train(shards: Path, run: Path, *extra: str) -> list[dict]:
    run_training(load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={run}",
                                    f"train.steps={STEPS}", "eval.grid_queries=3", *extra]))  # fmt: skip
    return read_metrics(run / "metrics.jsonl")


def pixels(png: bytes | Path) -> np.ndarray:
    data = png.read_bytes() if isinstance(png, Path) else png
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.slow
def test_tensorboard_events_hold_the_metrics_and_the_retrieval_picture(shards: Path, tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    records = train(shards, run, "train.log_with=[tensorboard]")
    (folder,) = (run / "tensorboard").iterdir()  # the project's folder, as accelerate names it
    assert folder.name == "ddp_rank"
    events = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0}).Reload()
    losses = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [e.step for e in events.Scalars("train/loss")] == [step for step, _ in losses]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([loss for _, loss in losses])
    (last_eval,) = [r for r in records if r["kind"] == "eval"]
    (recall,) = events.Scalars("eval/recall_at_1")  # "@" spelled out: MLflow refuses it in a name
    assert (recall.step, recall.value) == (STEPS, pytest.approx(last_eval["recall@1"]))
    (picture,) = events.Images("retrieval")
    assert picture.step == STEPS
    np.testing.assert_array_equal(pixels(picture.encoded_image_string), pixels(run / "retrieval.png"))
    if importlib.util.find_spec("matplotlib") is not None:  # the run's plots go there too
        (plot,) = events.Images("loss")
        np.testing.assert_array_equal(pixels(plot.encoded_image_string), pixels(run / "loss.png"))


@pytest.mark.slow
def test_mlflow_file_store_holds_the_metrics_the_config_and_the_retrieval_picture(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    allowed = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    run = tmp_path / "run"
    try:
        records = train(shards, run, "train.log_with=[mlflow]")
    finally:
        mlflow.set_tracking_uri(None)
        if allowed is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("ddp_rank")
    (logged,) = client.search_runs([experiment.experiment_id])
    assert logged.info.run_name == "run" and logged.info.status == "FINISHED"
    assert logged.data.params["train.steps"] == str(STEPS) and logged.data.params["eval.grid_queries"] == "3"
    history = client.get_metric_history(logged.info.run_id, "train/loss")
    losses = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    assert [m.step for m in history] == [step for step, _ in losses]
    assert [m.value for m in history] == pytest.approx([loss for _, loss in losses])
    (recall,) = client.get_metric_history(logged.info.run_id, "eval/recall_at_1")
    (last_eval,) = [r for r in records if r["kind"] == "eval"]
    assert (recall.step, recall.value) == (STEPS, pytest.approx(last_eval["recall@1"]))
    artifact = f"retrieval/step-{STEPS:08d}/retrieval.png"
    local = client.download_artifacts(logged.info.run_id, artifact, str(tmp_path / "download"))
    assert Path(local).read_bytes() == (run / "retrieval.png").read_bytes()


def test_a_tracker_without_its_package_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))  # fmt: skip
    cfg = load_config(None, ["train.log_with=[tensorboard,wandb]"])
    with pytest.raises(ConfigError, match=r"train.log_with=wandb needs the wandb package: pip install wandb"):
        tracker_arguments(cfg)
    assert tracker_arguments(load_config(None, [])) == {}  # nothing tracked: accelerate gets no tracker


def test_metric_names_every_tracker_accepts() -> None:
    assert tracker_key("eval", "recall@1") == "eval/recall_at_1"
    assert tracker_key("eval", "tpr@fpr=1e-3") == "eval/tpr_at_fpr_1e-3"
    assert tracker_key("train", "data_replaced_classes") == "train/data_replaced_classes"


def test_the_replaced_tensorboard_key_stops_with_one_line_naming_log_with(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"train.tensorboard was replaced by train.log_with: write"
    ) as caught:
        load_config(None, ["train.tensorboard=true"])
    assert "\n" not in str(caught.value)
    config = tmp_path / "config.yaml"
    config.write_text("train:\n  tensorboard: false\n  log_with: [mlflow]\n")
    with pytest.raises(ConfigError, match=rf"{config}: train.tensorboard was replaced by train.log_with"):
        load_config(config)
    with pytest.raises(ConfigError, match="log_with"):
        load_config(None, ["train.log_with=[tensorbord]"])


def test_an_accelerator_passed_without_the_trackers_is_refused(shards: Path, tmp_path: Path) -> None:
    """accelerate takes the trackers only when the Accelerator is made: one made without them would train and
    log nothing (and its blank tracker had no ``log_images``: the first evaluation picture crashed the run)."""
    pytest.importorskip("tensorboard")
    cfg = load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}",
                             "train.steps=1", "train.log_with=[tensorboard]"])  # fmt: skip
    with pytest.raises(
        TrainError, match=r"carries no tensorboard tracker: build it with Accelerator\(log_with="
    ):
        Trainer(cfg, accelerator=make_accelerator(cfg))
    trainer = Trainer(
        cfg, accelerator=make_accelerator(cfg, tracker_arguments(cfg))
    )  # built with them: taken
    trainer.close()


class _Tracker:
    def __init__(self, name: str, fails: bool = False) -> None:
        self.name, self.fails, self.images = name, fails, []

    def log_images(self, values: dict, step: int, **kwargs) -> None:
        if self.fails:
            raise RuntimeError("server gone")
        self.images.append((values, step))


def test_a_picture_goes_to_each_started_tracker_and_a_failing_one_costs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    png = tmp_path / "retrieval.png"
    drawn = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    Image.fromarray(drawn).save(png)
    broken, clearml, other = _Tracker("wandb", fails=True), _Tracker("clearml"), _Tracker("swanlab")
    blank = SimpleNamespace(name="custom")  # takes no pictures: left out
    accelerator = SimpleNamespace(is_main_process=True, trackers=[broken, blank, clearml, other])
    with caplog.at_level(logging.WARNING, logger="ddp_rank.train.trackers"):
        log_picture(accelerator, "retrieval", png, 7)
    (warning,) = caplog.records
    assert "the wandb tracker could not take the picture retrieval of step 7: server gone" in warning.message
    ((values, step),) = clearml.images  # ClearML takes one array per key
    assert step == 7 and isinstance(values["retrieval"], np.ndarray)
    np.testing.assert_array_equal(values["retrieval"], drawn)
    ((values, _),) = other.images  # the others a list of them
    np.testing.assert_array_equal(values["retrieval"][0], drawn)
    # An accelerator without started trackers takes no picture (accelerate's get_tracker gave a blank tracker,
    # without log_images: AttributeError at the first evaluation picture).
    log_picture(make_accelerator(load_config(None, ["distributed.cpu=true"])), "retrieval", png, 7)
