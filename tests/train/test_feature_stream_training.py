"""Training a head on feature shards read once (``FeatureStream``, fed inline): the same losses, step by step, as
the per-sample stream through the DataLoader and the threaded feed, for the same plan; and a resume continues the
same batches."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import ddp_rank.train.setup as setup
from ddp_rank.config import load_config
from ddp_rank.data.features.synthetic import write_feature_shards
from ddp_rank.data.reading.feature_stream import FeatureStream
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.train.trainer import Trainer, run_training
from tests.helpers.training import TINY_OVERRIDES, launch

pytestmark = pytest.mark.slow


def overrides(shards: Path, run: Path, steps: int = 6) -> list[str]:
    return [
        *TINY_OVERRIDES, "model.backbone=features", f"data.shards={shards}", "data.test_split=",
        f"train.output_dir={run}", f"train.steps={steps}", "data.sampler=random", "optim.schedule=cosine",
        "optim.warmup_steps=2", "train.checkpoint_every=3",
    ]  # fmt: skip


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_feature_shards(tmp_path_factory.mktemp("f") / "s", [4, 4, 4], images=4, dim=12, test_every=0)


def test_the_losses_are_those_of_the_per_sample_stream(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_training(load_config(None, overrides(shards, tmp_path / "table")))
    streams: list[Any] = []

    def per_sample(*args: Any, table_dir: Any = None, **kwargs: Any) -> ShardStream:
        streams.append(ShardStream(*args, **kwargs))
        return streams[-1]

    monkeypatch.setattr(setup, "FeatureStream", per_sample)  # today's path: tar walk per class and step
    run_training(load_config(None, overrides(shards, tmp_path / "per-sample")))
    assert streams and not isinstance(streams[0], FeatureStream)
    table, per_sample_losses = losses(tmp_path / "table"), losses(tmp_path / "per-sample")
    assert len(table) == 6
    assert table == per_sample_losses  # bit for bit: the same rows, in the same order, the same step


def test_the_trainer_reads_the_table_inline_and_resumes_exactly(shards: Path, tmp_path: Path) -> None:
    whole = tmp_path / "whole"
    run_training(load_config(None, overrides(shards, whole)))
    half = tmp_path / "half"
    trainer = Trainer(load_config(None, overrides(shards, half)))
    try:
        assert isinstance(trainer.stream, FeatureStream) and trainer.stream.num_workers == 0
        first = [trainer.train_step().loss for _ in range(3)]
        trainer.save_checkpoint()
    finally:
        trainer.close()
        trainer.accelerator.end_training()
    run_training(load_config(None, [*overrides(shards, half), f"train.resume={half}"]))
    assert first + losses(half) == losses(whole)


def test_two_processes_each_gather_their_part_of_the_same_batches(shards: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    run_training(load_config(None, overrides(shards, one)))
    proc = launch("train", *overrides(shards, two))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each rank's stream gathered its own rows of each step: the global batch, and so the loss, is that of one
    # process (up to the order of the float sums across the two ranks).
    assert losses(two) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
