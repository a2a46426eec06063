"""What each seed varies, checked on the trainer itself: ``train.seed`` the initial weights (and, by default, the
data), ``data.seed`` the batches and their augmentation alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddp_rank.config import load_config
from ddp_rank.train.trainer import Trainer
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny"))


def start(shards: Path, out: Path, *seeds: str) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """(initial weights, first batch's labels, first batch's pixels) of a trainer with these seeds."""
    cfg = load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}", *seeds])
    trainer = Trainer(cfg)
    try:
        weights = {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()}
        batch = trainer.batches.next()
        return weights, batch.labels.clone(), batch.images.clone()
    finally:
        trainer.close()


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_data_seed_varies_the_data_alone_and_train_seed_the_weights_alone(
    shards: Path, tmp_path: Path
) -> None:
    base = start(shards, tmp_path / "a", "train.seed=0", "data.seed=0")
    other_data = start(shards, tmp_path / "b", "train.seed=0", "data.seed=1")
    other_init = start(shards, tmp_path / "c", "train.seed=1", "data.seed=0")
    # data.seed: same initial weights, other batches.
    assert same_weights(base[0], other_data[0])
    assert not torch.equal(base[1], other_data[1])
    # train.seed with data.seed fixed: other initial weights, the very same pixels (classes, crops, flips).
    assert not same_weights(base[0], other_init[0])
    assert torch.equal(base[1], other_init[1]) and torch.equal(base[2], other_init[2])


@pytest.mark.slow
def test_without_data_seed_train_seed_varies_both(shards: Path, tmp_path: Path) -> None:
    default = start(shards, tmp_path / "a", "train.seed=1")
    explicit = start(shards, tmp_path / "b", "train.seed=1", "data.seed=1")
    assert same_weights(default[0], explicit[0]) and torch.equal(default[2], explicit[2])
    assert not torch.equal(default[1], start(shards, tmp_path / "c", "train.seed=0")[1])


@pytest.mark.slow
def test_a_resume_with_another_data_seed_is_refused(shards: Path, tmp_path: Path) -> None:
    """The checkpoint records the data's seed: a resume under another one would not see the interrupted run's
    batches. train.seed with data.seed fixed leaves the batches alone, so it is no such change."""
    from ddp_rank.model.checkpoint_read import CheckpointError
    from ddp_rank.train.trainer import run_training

    def cfg(*extra: str):
        return load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}",
                                  "train.seed=0", *extra])  # fmt: skip

    run_training(cfg("train.steps=2"))
    with pytest.raises(CheckpointError, match=r"seed: 0 -> 5"):
        run_training(cfg("train.steps=3", "data.seed=5"))
    assert run_training(cfg("train.steps=3", "data.seed=0"))["steps"] == 3  # the same data, spelled out
