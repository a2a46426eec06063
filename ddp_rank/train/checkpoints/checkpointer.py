"""A run's state, saved and restored the torchtitan way: objects that have ``state_dict`` / ``load_state_dict``,
and one :class:`Checkpointer` that takes them.

A checkpoint (the layout of ``write``) holds:

- accelerate's state, written and read by accelerate: the model, the optimizer, the gradient scaler, every rank's
  RNG; DeepSpeed's own files under DeepSpeed, with plain ``model.safetensors`` beside them for ``ddp-rank eval``;
- the objects accelerate is not given (``state_files``): the schedule as JSON, a loss's own parameters as
  safetensors;
- ``meta.json``, written last: the loop's :class:`~ddp_rank.train.train_state.TrainState` at its top level,
  the data's state (:class:`~ddp_rank.train.batches.TrainBatches`: position and schedule) under ``stream``, the
  run's config under ``config``.

Nothing is unpickled without restriction: every torch file of a checkpoint is scanned before anything reads it,
and accelerate's and DeepSpeed's own loads run weights-only (``ddp_rank.model.safe_pickles``).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

from ddp_rank.model.checkpoint_read import CheckpointError
from ddp_rank.model.safe_pickles import (
    RNG_STATE_TYPES,
    deepspeed_types,
    refusal_detail,
    unsafe_files,
    weights_only_loads,
)
from ddp_rank.train.checkpoints.state_files import SCHEDULER_FILE, load_state_files, save_state_files
from ddp_rank.train.checkpoints.write import CheckpointManager

if TYPE_CHECKING:
    from ddp_rank.train.batches import TrainBatches
    from ddp_rank.train.train_state import TrainState

__all__ = ["Checkpointer"]


@dataclass
class Checkpointer:
    """Save and restore the state of one run on every rank.

    ``accelerator`` holds the prepared ``model`` and optimizer; ``scheduler`` and ``loss`` (a loss's own
    parameters, or None) are written beside its files; ``train`` and ``data`` go to ``meta.json`` with
    ``config`` (the config's values, recorded, never restored). ``manager`` places the files atomically.
    """

    manager: CheckpointManager
    accelerator: Any
    model: nn.Module
    scheduler: Any
    loss: nn.Module | None
    train: TrainState
    data: TrainBatches
    config: dict[str, Any]
    deepspeed: bool

    # -- meta.json --------------------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        """What ``meta.json`` records of the run (the manager adds the files' digests)."""
        return {**self.train.state_dict(), "stream": self.data.state_dict(), "config": self.config}

    def check(self, path: Path, meta: dict[str, Any]) -> None:
        """Refuse, in one line naming ``path``, a checkpoint this version cannot continue (before anything of it
        is loaded): one written before the state files existed, or one whose ``meta.json`` holds no data position."""
        again = f"start a new run from its weights with model.init_from={path} and a new train.output_dir"
        if not (path / SCHEDULER_FILE).is_file() and any(path.glob("custom_checkpoint_*.pkl")):
            raise CheckpointError(
                f"checkpoint {path} was written by an earlier version of ddp-rank, whose checkpoints do not "
                f"resume; {again}"
            )
        problem = _position_problem(meta)
        if problem:
            raise CheckpointError(f"checkpoint {path}: {problem}; resume from another checkpoint, or {again}")

    def load_meta(self, meta: dict[str, Any], force: bool = False) -> None:
        """Continue the loop and the data where ``meta`` left them. Another global batch is refused
        (``TrainState``), then a changed data schedule unless ``force`` (``train.force_resume``): the resumed run
        would not see the batches of the one it continues."""
        problem = _position_problem(meta)
        if problem:
            raise CheckpointError(problem)
        saved = meta["stream"]
        changes = self.data.schedule_changes(saved)
        self.train.load_state_dict(meta)
        if changes and not force:
            raise CheckpointError(
                f"the data schedule differs from the checkpoint's ({changes}), so the resumed run would not see "
                "the batches of the interrupted one; restore those settings, or set train.force_resume=true"
            )
        self.data.load_state_dict(saved)

    # -- files --------------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Checkpoint ``step`` atomically (every rank); returns its folder."""
        return self.manager.save(step, self.meta(), self.save_files)

    def save_files(self, directory: Path) -> None:
        """Every rank: accelerate's state; the main rank: the schedule, the loss's parameters and, under
        DeepSpeed, plain weights (ZeRO-1/2 do not partition parameters: every rank holds them all)."""
        self.accelerator.save_state(str(directory))
        main = self.manager.is_main
        if main:
            save_state_files(directory, self.scheduler, self.loss)
        if self.deepspeed:
            state = self.accelerator.get_state_dict(self.model)
            if main:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))

    def refuse_unsafe_files(self, path: Path) -> None:
        """Refuse, by name, a torch file of ``path`` that names a function or class outside the types this run's
        checkpoints may hold. Why a scan besides the weights-only loads: it names the file and the culprit in
        one line, and accelerate skips random states it cannot read with no more than an info line (the run
        would resume with other random numbers). The weights-only loads stop what a static scan cannot see."""
        problem = unsafe_files(path, self._allowed_types())
        if problem is not None:
            raise CheckpointError(
                f"checkpoint {path} is refused: {problem}; resume from a checkpoint you trust, or start afresh"
            )

    def load_files(self, path: Path) -> None:
        """``accelerator.load_state`` of a checked checkpoint (:meth:`check`, :meth:`refuse_unsafe_files`), then
        the schedule and the loss's parameters; a failure is one line naming the checkpoint."""
        try:
            with weights_only_loads(self._allowed_types()):
                self.accelerator.load_state(str(path))
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint {path} cannot be loaded ({_load_error(exc)}); resume from another one with "
                "train.resume=<a step-* directory>, or move it aside"
            ) from exc
        load_state_files(path, self.scheduler, self.loss)

    def _allowed_types(self) -> list[Any]:
        """The types beyond torch's defaults a checkpoint of this run may hold: numpy's random state, and
        DeepSpeed's own classes under DeepSpeed."""
        return [*RNG_STATE_TYPES, *(deepspeed_types() if self.deepspeed else [])]


_POSITION = ("epoch", "step", "steps_per_epoch")


def _position_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the data position ``meta.json`` records (``stream.epoch``, ``stream.step``: whole
    numbers from 0, in epochs of ``stream.steps_per_epoch`` steps), or None."""
    stream = meta.get("stream")
    epoch, step, length = (stream.get(k) if isinstance(stream, dict) else None for k in _POSITION)
    if _whole(epoch, 0) and _whole(step, 0) and (length is None or _whole(length, 1)):
        return None
    found = ", ".join(f"{k} {v!r}" for k, v in zip(_POSITION, (epoch, step, length)))
    return f"its meta.json records no data position (stream: {found})"


def _whole(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _load_error(exc: BaseException) -> str:
    """One line for a failed ``load_state``; a weights-only refusal by the line that names what was refused."""
    if isinstance(exc, pickle.UnpicklingError):
        return refusal_detail(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
