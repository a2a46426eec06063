"""Run ``ddp-rank train`` with a failure injected on rank 1 at its second step (for tests/train/test_failures.py).

    accelerate launch ... tests/fail_one_rank.py WHERE [section.key=value ...]

WHERE is ``loss`` (an exception inside the global loss's rows: the loss layer reports it on every rank) or
``forward`` (an exception in the backbone's forward, before any collective of the step: only this rank knows).
"""

from __future__ import annotations

import os
import sys

from torch import nn

import ddp_rank.train.setup as setup_module
from ddp_rank.cli import main

WHERE = sys.argv[1]
RANK = int(os.environ.get("RANK", "0"))
FAIL_AT_CALL = 2
MESSAGE = "CUDA out of memory. Tried to allocate 20.00 GiB (simulated)"


class _Counter:
    calls = 0

    @classmethod
    def tick(cls) -> None:
        cls.calls += 1
        if RANK == 1 and cls.calls == FAIL_AT_CALL:
            raise RuntimeError(MESSAGE)


def _failing_loss(cfg):  # type: ignore[no-untyped-def]
    loss = _build_loss(cfg)
    rows = loss.rows

    def failing_rows(*args, **kwargs):  # type: ignore[no-untyped-def]
        _Counter.tick()
        return rows(*args, **kwargs)

    loss.rows = failing_rows  # type: ignore[method-assign]
    return loss


class _FailingForward(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, x):  # type: ignore[no-untyped-def]
        if self.training:
            _Counter.tick()
        return self.inner(x)


def _failing_model(*args, **kwargs):  # type: ignore[no-untyped-def]
    model = _build_model(*args, **kwargs)
    model.backbone = _FailingForward(model.backbone)
    return model


# The trainer builds its loss through setup.build_training_loss, which calls setup's build_loss.
_build_loss, _build_model = setup_module.build_loss, setup_module.build_model
if WHERE == "loss":
    setup_module.build_loss = _failing_loss
else:
    setup_module.build_model = _failing_model

sys.exit(main(["train", *sys.argv[2:]]))
