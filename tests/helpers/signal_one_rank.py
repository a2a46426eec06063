"""Run ``ddp-rank train`` and send a stop signal to rank 1 in the middle of a phase (for
tests/train/test_preemption.py).

    accelerate launch ... tests/helpers/signal_one_rank.py PHASE STEP SIGNAL [section.key=value ...]

PHASE is ``step`` (inside the forward-backward of step STEP: with a chunk size, between the chunks' passes),
``eval`` (inside the evaluation after step STEP) or ``checkpoint`` (while the checkpoint of step STEP is being
written). The signal goes to rank 1 only: the trainer's agreement must carry it to rank 0.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import ddp_rank.train.trainer as trainer_module
from ddp_rank.cli import main
from ddp_rank.train.checkpoints.checkpointer import Checkpointer

PHASE, STEP, SIGNAL = sys.argv[1], int(sys.argv[2]), signal.Signals[sys.argv[3]]
RANK = int(os.environ.get("RANK", "0"))


def _signal_me() -> None:
    if RANK == 1:
        os.kill(os.getpid(), SIGNAL)



_state: dict[str, Any] = {}
_forward_backward, _evaluate, _save_state = (
    trainer_module.forward_backward,
    trainer_module.Trainer.evaluate,
    Checkpointer.save_files,
)
_init = trainer_module.Trainer.__init__


def _remember(self: Any, *args: Any, **kwargs: Any) -> None:
    _state["trainer"] = self
    _init(self, *args, **kwargs)


def _forward_backward_signalled(*args: Any, **kwargs: Any) -> Any:
    if _state["trainer"].step + 1 == STEP:  # the step being computed
        _signal_me()
    return _forward_backward(*args, **kwargs)


def _evaluate_signalled(self: Any) -> Any:
    if self.step == STEP:
        _signal_me()
    return _evaluate(self)


def _save_state_signalled(self: Any, directory: Any) -> None:
    if self.train.step == STEP:
        _signal_me()
    _save_state(self, directory)


trainer_module.Trainer.__init__ = _remember  # type: ignore[method-assign]
if PHASE == "step":
    trainer_module.forward_backward = _forward_backward_signalled
elif PHASE == "eval":
    trainer_module.Trainer.evaluate = _evaluate_signalled  # type: ignore[method-assign]
else:
    Checkpointer.save_files = _save_state_signalled  # type: ignore[method-assign]

sys.exit(main(["train", *sys.argv[4:]]))
