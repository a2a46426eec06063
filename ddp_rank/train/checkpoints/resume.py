"""Continuing a run: what a checkpoint records besides the accelerate state (``meta.json``), the checks before a
resume (world size, model and optimizer settings, weight shapes, the data schedule), and a rewind's clean-up.

The stream is a pure function of (seed, epoch, step), so a resumed run restarts it at the checkpoint's step on any
world size and worker count and ends with the parameters of an uninterrupted one. Functions of the trainer they
continue (``Trainer.resume`` / ``state_dict`` / ``load_state_dict`` call them), written against ``ResumedRun``:
what they read and restore of the run, so this module does not import the trainer that imports it.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddp_rank.model import init_from
from ddp_rank.model.checkpoint_read import (
    CheckpointError,
    newest_intact_checkpoint,
    read_meta,
    resolve_checkpoint,
    verify_checkpoint,
)
from ddp_rank.model.safe_pickles import (
    RNG_STATE_TYPES,
    deepspeed_types,
    refusal_detail,
    unsafe_files,
    weights_only_loads,
)
from ddp_rank.train.checkpoints.resume_check import describe_changes, resume_changes, tensor_changes
from ddp_rank.train.checkpoints.state_files import accelerate_view, load_state_files
from ddp_rank.train.checkpoints.write import check_world_size
from ddp_rank.train.optim import lr_factor

if TYPE_CHECKING:
    from ddp_rank.data.reading.stream import ShardStream
    from ddp_rank.model import EmbeddingNet
    from ddp_rank.train.batches import TrainBatches
    from ddp_rank.train.checkpoints.write import CheckpointManager
    from ddp_rank.train.run_report import RunReport
    from ddp_rank.train.settings import TrainSettings

__all__ = ["ResumedRun", "load_state_dict", "resume", "schedule_signature", "state_dict"]


class RunProgress(Protocol):
    """The loop's own counters, recorded in ``meta.json`` and set back on a resume."""

    step: int
    best_value: float | None
    best_step: int | None


class ResumedRun(Protocol):
    """What a resume reads and restores of the run it continues; ``Trainer`` is one. Read-only members: the
    functions here change the objects (the scheduler, the stream, the progress), never which objects they are."""

    @property
    def settings(self) -> TrainSettings: ...
    @property
    def accelerator(self) -> Any: ...
    @property
    def optimizer(self) -> Any: ...
    @property
    def scheduler(self) -> Any: ...
    @property
    def loss_state(self) -> Any: ...
    @property
    def deepspeed(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def out_dir(self) -> Path: ...
    @property
    def stream(self) -> ShardStream: ...
    @property
    def batches(self) -> TrainBatches: ...
    @property
    def checkpoints(self) -> CheckpointManager: ...
    @property
    def report(self) -> RunReport: ...
    @property
    def progress(self) -> RunProgress: ...
    @property
    def steps_per_epoch(self) -> int: ...
    @property
    def total_steps(self) -> int: ...
    @property
    def step(self) -> int: ...
    @property
    def unwrapped(self) -> EmbeddingNet: ...
    def parameter_groups(self, model: EmbeddingNet) -> list[dict[str, Any]]: ...


def state_dict(trainer: ResumedRun) -> dict[str, Any]:
    """The loop state that goes to ``meta.json`` (the rest is in the accelerate checkpoint)."""
    epoch, step_in_epoch = divmod(trainer.progress.step, trainer.steps_per_epoch)
    return {
        "step": trainer.progress.step,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
        "world_size": trainer.world_size,
        "global_batch_size": trainer.settings.data.global_batch_size,
        "total_steps": trainer.total_steps,
        "best_value": trainer.progress.best_value,
        "best_step": trainer.progress.best_step,
        "best_metric": trainer.settings.train.best_metric,
        "stream": {**trainer.stream.state_dict(), **schedule_signature(trainer)},
        "config": trainer.settings.report.config.values,
    }


def schedule_signature(trainer: ResumedRun) -> dict[str, Any]:
    """What decides which samples each step draws, besides the layout the stream itself records."""
    data = trainer.settings.data
    return {
        "seed": trainer.settings.data_seed,
        "sampler": trainer.stream.schedule_config.strategy,  # data.sampler=auto resolved
        "categories_per_batch": data.categories_per_batch,
        "batches_per_pair": data.batches_per_pair,
        "images_per_class": data.images_per_class,
        "category_aware": data.category_aware,
        "steps_per_epoch": trainer.steps_per_epoch,
    }


def load_state_dict(trainer: ResumedRun, meta: dict[str, Any]) -> None:
    """Continue at ``meta['step']``: the stream is positioned there and the best-so-far restored."""
    if (
        int(meta.get("global_batch_size", trainer.settings.data.global_batch_size))
        != trainer.settings.data.global_batch_size
    ):
        raise CheckpointError(
            f"the checkpoint was trained with data.global_batch_size={meta['global_batch_size']}, this run "
            f"uses {trainer.settings.data.global_batch_size}; resume with the same global batch or start afresh"
        )
    saved = meta.get("stream", {})
    changed = {
        k: (v, saved[k]) for k, v in schedule_signature(trainer).items() if k in saved and saved[k] != v
    }
    if changed and not trainer.settings.train.force_resume:
        details = ", ".join(f"{k}: {old} -> {new}" for k, (new, old) in changed.items())
        raise CheckpointError(
            f"the data schedule differs from the checkpoint's ({details}), so the resumed run would not see "
            "the batches of the interrupted one; restore those settings, or set train.force_resume=true"
        )
    trainer.progress.step = int(meta["step"])
    trainer.progress.best_value = meta.get("best_value")
    trainer.progress.best_step = meta.get("best_step")
    epoch, step_in_epoch = divmod(trainer.progress.step, trainer.steps_per_epoch)
    # The plan depends neither on the world size nor on the workers: any layout continues the sequence.
    trainer.stream.load_state_dict({"epoch": epoch, "step": step_in_epoch})
    trainer.batches.restart()


def resume(trainer: ResumedRun) -> Path | None:
    """Apply ``train.resume``; returns the checkpoint continued from, or None for a fresh start."""
    mode = trainer.settings.train.resume
    set_aside = trainer.checkpoints.cleanup_partial().set_aside
    if set_aside:
        trainer.report.note(
            f"{len(set_aside)} checkpoint folder(s) without meta.json (not written by ddp-rank's atomic save: a "
            f"copy cut short?) moved to {set_aside[0].parent}, kept and never resumed from: "
            + ", ".join(p.name for p in set_aside)
        )
    if mode == "never":
        if trainer.checkpoints.latest() is not None:
            raise CheckpointError(
                f"{trainer.checkpoints.root} already holds checkpoints and train.resume=never: use a new "
                "train.output_dir, delete the old run, or train.resume=auto to continue it"
            )
        return None
    path = (
        _intact_latest(trainer) if mode == "auto" else verify_checkpoint(resolve_checkpoint(mode, "latest"))
    )
    if path is None:
        return None
    meta = read_meta(path)
    _refuse_unsafe_files(trainer, path)
    force = trainer.settings.train.force_resume
    # Only DeepSpeed's partitioned optimizer state ties a checkpoint to its world size: the data plan does not.
    check_world_size(meta, trainer.world_size, force or not trainer.deepspeed, str(path))
    # The saved weights' shapes as well: not every shape is a model.* key (a ViT's position embeddings follow
    # data.image_size), and load_state would fail on them with a bare size-mismatch traceback.
    changes = resume_changes(meta, trainer.settings.report.config, trainer.total_steps) + tensor_changes(
        path, trainer.unwrapped
    )
    if changes and not force:
        reshaped = [c.key for c in changes if c.is_tensor]
        vit = any("pos_embed" in key for key in reshaped)
        hint = ": a timm ViT's position embeddings follow data.image_size" if vit else ""
        shapes = f" (its weights have other shapes{hint})" if reshaped else ""
        raise CheckpointError(
            f"checkpoint {path} was trained with another model, loss or optimizer setting ({describe_changes(changes)})"
            f"{shapes}; resuming would ignore or break on them. Restore those values, start a new run from its "
            f"weights with model.init_from={path} and a new train.output_dir, or set train.force_resume=true to "
            "continue with the new values"
        )
    if any(c.structural for c in changes):
        # The saved parameters / optimizer state do not fit: take the weights that do, a fresh optimizer.
        report = init_from(trainer.unwrapped, path)
        trainer.report.note(
            f"forced resume from {path} with a changed model or optimizer: the optimizer state and RNG are "
            f"not restored.\n{report.summary()}"
        )
    else:
        _load_accelerate_state(trainer, path)
    load_state_dict(trainer, meta)
    if changes:
        _apply_optim_config(trainer)
        # Tensors of another shape are in init_from's report above.
        settings = [c for c in changes if not c.is_tensor]
        if settings:
            trainer.report.note(
                f"forced resume from {path}: the new values apply: {describe_changes(settings)}"
            )
    if mode != "auto" and trainer.out_dir.resolve() not in path.resolve().parents:
        trainer.report.note(
            f"continuing {mode} at step {trainer.step} with its optimizer state (train.resume); to start from "
            "its weights only, use model.init_from"
        )
    _abandon_later_checkpoints(trainer, meta)
    return path


def _intact_latest(trainer: ResumedRun) -> Path | None:
    """The newest checkpoint of this run whose files are intact (``model.checkpoint_read``), each newer,
    damaged one noted in one line; it is moved aside with the other later checkpoints once the resume is done
    (:func:`_abandon_later_checkpoints`). Every rank checks (each reads the files it loads anyway)."""
    path, damaged = newest_intact_checkpoint(trainer.checkpoints.root)
    if damaged and path is None:
        newest, problem = damaged[0]
        raise CheckpointError(
            f"checkpoint {newest} is damaged ({problem}) and no earlier checkpoint of the run is intact: restore "
            f"the files from a copy, or move {trainer.checkpoints.root} aside to start afresh"
        )
    for bad, problem in damaged:
        trainer.report.note(f"checkpoint {bad} is damaged ({problem}): continuing from {path} instead")
    return path


def _load_accelerate_state(trainer: ResumedRun, path: Path) -> None:
    """``accelerator.load_state`` of a checked checkpoint, then the state the trainer writes itself
    (``checkpoints.state_files``); what a parser still refuses (a file the checks could not judge: a
    checkpoint of an older version) becomes one line naming the checkpoint.

    accelerate's and DeepSpeed's own ``torch.load`` calls run weights-only, with the types of
    :func:`_allowed_types` (:func:`_refuse_unsafe_files` has scanned every torch file before).
    """
    try:
        with weights_only_loads(_allowed_types(trainer)), accelerate_view(path) as folder:
            trainer.accelerator.load_state(str(folder))
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be loaded ({_load_error(exc)}); resume from another one with "
            "train.resume=<a step-* directory>, or move it aside"
        ) from exc
    load_state_files(path, trainer.scheduler, trainer.loss_state)


def _allowed_types(trainer: ResumedRun) -> list[Any]:
    """The types beyond torch's defaults a checkpoint of this run may hold: numpy's random state, and DeepSpeed's
    own classes under DeepSpeed (``ddp_rank.model.safe_pickles``)."""
    return [*RNG_STATE_TYPES, *(deepspeed_types() if trainer.deepspeed else [])]


def _refuse_unsafe_files(trainer: ResumedRun, path: Path) -> None:
    """No file of a checkpoint is unpickled without restriction: every torch file in it is scanned before
    anything reads it, and refused by name when it names a function or class outside :func:`_allowed_types`.

    Why a scan besides the weights-only loads: it names the file and the culprit in one line, and accelerate
    skips random states it cannot read with no more than an info line (the run would resume with other random
    numbers). The weights-only loads stop what a static scan cannot see."""
    problem = unsafe_files(path, _allowed_types(trainer))
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {path} is refused: {problem}; resume from a checkpoint you trust, or start afresh"
        )


def _load_error(exc: BaseException) -> str:
    """One line for a failed ``load_state``; a weights-only refusal by the line that names what was refused."""
    if isinstance(exc, pickle.UnpicklingError):
        return refusal_detail(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _abandon_later_checkpoints(trainer: ResumedRun, meta: dict[str, Any]) -> None:
    """A rewind (this run continues at step s while its output_dir holds checkpoints after s, e.g. resumed
    from an earlier one after a divergence): move those aside, as metrics.jsonl is cut back to s, so that the
    next ``train.resume=auto`` continues this timeline, not the abandoned one. Collective (all ranks)."""
    best = None
    if meta.get("best_step") is not None and meta.get("best_value") is not None:
        metric = str(meta.get("best_metric", trainer.settings.train.best_metric))
        best = (int(meta["best_step"]), metric, float(meta["best_value"]))
    folder, moved = trainer.checkpoints.abandon_after(trainer.step, best)
    if folder is not None:
        trainer.report.note(
            f"rewound to step {trainer.step}: the later checkpoints of this run ({', '.join(moved)}) were moved to "
            f"{folder} so that train.resume=auto continues from here; delete that folder once you no longer "
            "need them"
        )


def _apply_optim_config(trainer: ResumedRun) -> None:
    """Make this config's optimizer hyper-parameters apply at the current step (the restored optimizer and
    schedule carry the checkpoint's: base rates, weight decay, betas, momentum)."""
    o = trainer.settings.optim
    fresh = trainer.parameter_groups(trainer.unwrapped)
    factor = lr_factor(o, trainer.total_steps)(trainer.step)
    for group, new in zip(trainer.optimizer.param_groups, fresh):
        group["initial_lr"] = new["lr"]
        group["lr"] = new["lr"] * factor
        group["weight_decay"] = new["weight_decay"]
        if "betas" in group:
            group["betas"] = tuple(o.betas)
        if "momentum" in group:
            group["momentum"] = o.momentum
    trainer.scheduler.base_lrs = [g["lr"] for g in fresh]
    trainer.scheduler.last_epoch = trainer.step
    trainer.scheduler._last_lr = [g["lr"] for g in trainer.optimizer.param_groups]
