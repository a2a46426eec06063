"""One config, two memory budgets: the batch fits on one "machine" and is chunked on the other, and both train
the same function (issue: a run on an 80 GB GPU and one on a 24 GB GPU must not train different models).

The trainer runs with ``distributed.chunk_size=auto``: ``memory_budget_mb=0`` (the node's memory: the batch fits,
direct step) against ``memory_budget_mb=1`` (chunks). The model is the tiny CNN, whose BatchNorm layers train in
ghost batch normalisation (``model.bn_group_size``) or, by default, are frozen in both steps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.testing import assert_close

from ddp_rank.config import load_config
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards

STEPS = 3


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("bn"))


def _train(shards: Path, out: Path, budget_mb: int, extra: tuple[str, ...]) -> dict[str, Any]:
    from ddp_rank.train.trainer import Trainer

    overrides = [o for o in TINY_OVERRIDES if not o.startswith(("data.global_batch_size", "data.image_size"))]
    cfg = load_config(None, [*overrides, f"data.shards={shards}", f"train.output_dir={out}", "data.test_split=",
                             "data.global_batch_size=32", "data.image_size=32", "data.resize_size=32",
                             "optim.name=sgd", "optim.lr=0.05", f"train.steps={STEPS}",
                             f"distributed.memory_budget_mb={budget_mb}", *extra])  # fmt: skip
    trainer = Trainer(cfg)
    grads: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizer.step

    def record_then_step(*args: Any, **kwargs: Any) -> Any:
        grads.append({n: p.grad.clone() for n, p in trainer.unwrapped.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = record_then_step  # type: ignore[method-assign]
    try:
        losses = [trainer.train_step() for _ in range(STEPS)]
        return {
            "chunk": trainer.layout.chunk_size,
            "losses": [r.loss for r in losses],
            "chunks": [r.chunks for r in losses],
            "grads": grads,
            "state": {k: v.clone() for k, v in trainer.unwrapped.state_dict().items()},
        }
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("extra", "mode"),
    [
        (("model.bn_group_size=4",), "train mode, statistics of each group of 4 local images"),
        ((), "frozen: running statistics in every step"),  # the default: model.freeze_bn=auto
    ],
    ids=["ghost-groups-of-4", "default-frozen"],
)
@pytest.mark.slow
def test_a_batch_that_fits_and_the_same_batch_chunked_train_the_same_model(
    shards: Path, tmp_path: Path, ddp_rank_log: pytest.LogCaptureFixture, extra: tuple[str, ...], mode: str
) -> None:
    ddp_rank_log.set_level(logging.INFO, logger="ddp_rank")
    fits = _train(shards, tmp_path / "fits", 0, extra)
    chunked = _train(shards, tmp_path / "chunked", 1, extra)
    assert fits["chunk"] is None and fits["chunks"] == [1] * STEPS
    assert chunked["chunk"] is not None and chunked["chunks"][0] > 1
    if extra:
        assert chunked["chunk"] % 4 == 0, "chunks hold whole BatchNorm groups"
    said = [r.getMessage() for r in ddp_rank_log.records if r.getMessage().startswith("BatchNorm: ")]
    assert len(said) == 2 and all(mode in line for line in said), said

    assert_close(chunked["losses"][0], fits["losses"][0], rtol=1e-6, atol=1e-7)
    for name, g in fits["grads"][0].items():
        assert_close(chunked["grads"][0][name], g, rtol=1e-4, atol=1e-6, msg=f"step 1 gradient of {name}")
    assert_close(chunked["losses"], fits["losses"], rtol=1e-5, atol=1e-6)
    for key, value in fits["state"].items():  # weights and running statistics after the last step
        assert_close(chunked["state"][key], value, rtol=1e-4, atol=1e-5, msg=key)
    running = [k for k in fits["state"] if k.endswith("running_mean")]
    changed = any(not torch.equal(fits["state"][k], torch.zeros_like(fits["state"][k])) for k in running)
    assert changed is bool(extra), "ghost groups update the running statistics; frozen BatchNorm does not"
