"""The loop's own state (torchtitan's ``TrainState``): the step and the best evaluation so far, with the run's
shape that a checkpoint's ``meta.json`` records beside them and a resume checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddp_rank.model.checkpoint_read import CheckpointError

__all__ = ["TrainState"]


@dataclass
class TrainState:
    """``step`` counts optimizer steps; ``best_value`` / ``best_step`` are the best ``best_metric`` so far. The
    other fields are fixed at start-up: what the step means (its epoch, the global batch) and what the run is."""

    steps_per_epoch: int
    total_steps: int
    world_size: int
    global_batch_size: int
    best_metric: str
    step: int = 0
    best_value: float | None = None
    best_step: int | None = None

    def state_dict(self) -> dict[str, Any]:
        epoch, step_in_epoch = divmod(self.step, self.steps_per_epoch)
        return {
            "step": self.step,
            "epoch": epoch,
            "step_in_epoch": step_in_epoch,
            "world_size": self.world_size,
            "global_batch_size": self.global_batch_size,
            "total_steps": self.total_steps,
            "best_value": self.best_value,
            "best_step": self.best_step,
            "best_metric": self.best_metric,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state['step']`` with its best so far. Another global batch is refused: the steps would
        not be those of the run continued (the world size is the checkpointer's to check: ZeRO ties to it)."""
        saved = int(state.get("global_batch_size", self.global_batch_size))
        if saved != self.global_batch_size:
            raise CheckpointError(
                f"the checkpoint was trained with data.global_batch_size={saved}, this run uses "
                f"{self.global_batch_size}; resume with the same global batch or start afresh"
            )
        self.step = int(state["step"])
        self.best_value = state.get("best_value")
        self.best_step = state.get("best_step")
