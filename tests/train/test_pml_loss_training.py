"""The trainer with a pytorch-metric-learning loss (``loss.name=pml:...``): a proxy loss trained on 2 gloo
processes equals one process (weights and proxies), its proxies stay equal on every rank, are saved in the
checkpoint and resumed; bad names, arguments and combinations fail at start-up with one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from ddp_rank.config import ConfigError, load_config
from ddp_rank.train.trainer import Trainer, run_training
from tests.helpers.distributed import run_distributed
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


@pytest.fixture(scope="module", autouse=True)
def _pytorch_metric_learning() -> None:
    """Imported when this file's tests run, not by every worker that collects the suite; without it the file
    is skipped."""
    pytest.importorskip("pytorch_metric_learning")


STEPS = 3
# BatchNorm frozen: the statistics of 16 images in one process and of 2 x 8 on two ranks would differ.
PROXY = [
    "loss.name=pml:ProxyAnchorLoss(margin=0.1, alpha=32)",
    "model.freeze_bn=always",
    "loss.params_lr_mult=5",
]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny-pml"))


def cfg_for(shards: Path | str, out: Path | str, *extra: str):
    return load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}", *extra])


def _train(shards: str, out: str, extra: tuple[str, ...]) -> dict[str, object]:
    trainer = Trainer(cfg_for(shards, out, f"train.steps={STEPS}", *extra))
    try:
        proxies_before = trainer.loss_parameters[0].detach().clone()
        losses = [trainer.train_step().loss for _ in range(STEPS)]
        return {
            "losses": losses,
            "before": proxies_before,
            "proxies": trainer.loss_parameters[0].detach().clone(),
            "weights": {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()},
        }
    finally:
        trainer.close()


def _rank_worker(rank: int, world: int, shards: str, out: str, extra: tuple[str, ...]) -> dict[str, object]:
    return _train(shards, out, extra)


@pytest.mark.distributed
@pytest.mark.parametrize("chunk", ["0", "3"], ids=["direct", "chunked"])
def test_proxy_loss_on_two_processes_equals_one(shards: Path, tmp_path: Path, chunk: str) -> None:
    # SGD, not Adam: Adam's normalised step turns rounding noise in a near-zero gradient into a full step.
    extra = (*PROXY, f"distributed.chunk_size={chunk}", "optim.name=sgd", "optim.lr=0.05")
    ranks = run_distributed(_rank_worker, 2, args=(str(shards), str(tmp_path / "two"), extra), timeout=120)
    one = _train(str(shards), str(tmp_path / "one"), extra)
    assert not torch.equal(one["proxies"], one["before"]), "the optimizer must move the proxies"
    assert torch.equal(ranks[0]["proxies"], ranks[1]["proxies"]), "the proxies differ across ranks"
    assert ranks[0]["losses"] == ranks[1]["losses"], "the ranks log different global losses"
    assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert_close(ranks[0]["proxies"], one["proxies"], rtol=1e-4, atol=1e-6)
    for name, value in one["weights"].items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name
        assert_close(ranks[0]["weights"][name], value, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.slow  # four short runs: out of make test-fast
def test_proxies_are_saved_and_resumed(shards: Path, tmp_path: Path) -> None:
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    run_training(cfg_for(shards, straight, *PROXY, "train.steps=4"))
    logged = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert {r["lr_head"] for r in logged if r["kind"] == "train"} == {1e-2}, (
        "the head's rate, not the proxies'"
    )
    run_training(cfg_for(shards, halves, *PROXY, "train.steps=2"))
    trainer = Trainer(cfg_for(shards, halves, *PROXY, "train.steps=4"))
    try:
        saved = trainer.loss_parameters[0].detach().clone()
        trainer.resume()
        assert trainer.step == 2 and not torch.equal(trainer.loss_parameters[0], saved), (
            "proxies not restored"
        )
        for _ in range(2):
            trainer.train_step()
        resumed = trainer.loss_parameters[0].detach().clone()
    finally:
        trainer.close()
    reference = Trainer(cfg_for(shards, straight, *PROXY, "train.steps=4"))
    try:
        reference.resume()
        assert reference.step == 4
        assert_close(resumed, reference.loss_parameters[0].detach(), rtol=0, atol=0)
    finally:
        reference.close()


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["loss.name=pml:ContrastivLoss"], "has no loss named 'ContrastivLoss'"),
        (["loss.name=pml:ContrastiveLoss(pos_margn=0)"], "refused its arguments"),
        (["loss.name=pml:ContrastiveLoss(0)"], "arguments by name only"),
        (["loss.miner=pml:MultiSimilarityMiner"], "takes no mined tuples"),
        (
            ["loss.name=pml:TripletMarginLoss", "loss.miner=pml:TripletMiner"],
            "has no miner named 'TripletMiner'",
        ),
    ],
)
def test_bad_pml_settings_fail_at_start_up(
    shards: Path, tmp_path: Path, overrides: list[str], words: str
) -> None:
    with pytest.raises(ConfigError) as info:
        Trainer(cfg_for(shards, tmp_path / "run", *overrides)).close()
    assert words in str(info.value) and "\n" not in str(info.value)


def test_missing_pml_is_one_clear_line(shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "pytorch_metric_learning", None
    )  # what an install without the extra sees
    with pytest.raises(
        ConfigError, match=r"needs pytorch-metric-learning, which is not installed: pip install"
    ):
        Trainer(cfg_for(shards, tmp_path / "run", "loss.name=pml:ContrastiveLoss")).close()


@pytest.mark.parametrize(
    ("plugin", "precision"), [(object(), "no"), (None, "fp16")], ids=["deepspeed", "fp16"]
)
def test_loss_parameters_are_refused_where_they_cannot_be_trained(plugin: object, precision: str) -> None:
    """DeepSpeed and fp16 loss scaling handle only the model's parameters: a proxy loss is refused up front
    (a loss without parameters is not)."""
    from types import SimpleNamespace

    from pytorch_metric_learning import losses

    from ddp_rank.runtime import TrainError
    from ddp_rank.train.setup import TrainingLoss, trainable_loss_parameters

    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), mixed_precision=precision)
    proxies, plain = TrainingLoss(losses.ProxyAnchorLoss(5, 4)), TrainingLoss(losses.ContrastiveLoss())
    with pytest.raises(TrainError, match="has parameters of its own, which this run cannot train"):
        trainable_loss_parameters(proxies, accelerator, torch.device("cpu"), "pml:ProxyAnchorLoss")
    assert trainable_loss_parameters(plain, accelerator, torch.device("cpu"), "pml:ContrastiveLoss") == []
