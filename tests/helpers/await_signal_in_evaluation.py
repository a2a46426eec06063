"""Run ``ddp-rank train`` in one process and, inside the evaluation after step STEP, wait for a stop signal sent
from outside (for tests/train/test_preemption.py).

    python tests/helpers/await_signal_in_evaluation.py STEP READY_FILE [section.key=value ...]

Once the evaluation has read its first batch, the DataLoader workers of the evaluation and of the training loader
(in the middle of its epoch) are running: the helper then creates READY_FILE and waits, up to 60 s, until the run
has received a stop signal. The test sends it to the whole process group, workers included, as SLURM and
torchrun do; a signal from the test, not from this process, is what a worker sees from a scheduler (torch's
workers treat a SIGTERM from their parent apart).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ddp_rank.eval.runner as runner
import ddp_rank.train.trainer as trainer_module
from ddp_rank.cli import main

STEP, READY = int(sys.argv[1]), Path(sys.argv[2])

_state: dict[str, Any] = {}
_init = trainer_module.Trainer.__init__
_embed_batches = runner.embed_batches


def _remember(self: Any, *args: Any, **kwargs: Any) -> None:
    _state["trainer"] = self
    _init(self, *args, **kwargs)


def _await_the_signal() -> None:
    stop = _state["trainer"].stop
    READY.touch()
    deadline = time.monotonic() + 60
    while not stop.requested:
        if time.monotonic() > deadline:
            raise TimeoutError("no stop signal came")
        time.sleep(0.01)


def _embed_batches_awaiting(model: Any, batches: Iterable[Any], **kwargs: Any) -> Any:
    def first_then_await() -> Iterator[Any]:
        for index, batch in enumerate(batches):
            yield batch
            if index == 0 and _state["trainer"].step == STEP:
                _await_the_signal()

    return _embed_batches(model, first_then_await(), **kwargs)


trainer_module.Trainer.__init__ = _remember  # type: ignore[method-assign]
runner.embed_batches = _embed_batches_awaiting

sys.exit(main(["train", *sys.argv[3:]]))
