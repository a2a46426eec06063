"""Continuing a run (``train.resume``): the newest intact checkpoint found, the checks before a resume (world size,
model and optimizer settings, weight shapes, the data schedule), the state restored through the run's
:class:`~ddp_rank.train.checkpoints.checkpointer.Checkpointer`, and a rewind's clean-up.

The stream is a pure function of (seed, epoch, step), so a resumed run restarts it at the checkpoint's step on any
world size and worker count and ends with the parameters of an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_rank.config import TrainConfig
from ddp_rank.model import init_from
from ddp_rank.model.checkpoint_read import (
    CheckpointError,
    newest_intact_checkpoint,
    read_meta,
    resolve_checkpoint,
    verify_checkpoint,
)
from ddp_rank.train.checkpoints.checkpointer import Checkpointer
from ddp_rank.train.checkpoints.resume_check import (
    ConfigChange,
    describe_changes,
    resume_changes,
    tensor_changes,
)
from ddp_rank.train.checkpoints.write import check_world_size
from ddp_rank.train.run_outputs import ConfigRecord

__all__ = ["Resumed", "resume"]


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run continues, and the settings a forced resume changed (the caller applies the
    optimizer's: the restored optimizer and schedule carry the checkpoint's)."""

    path: Path
    changes: list[ConfigChange]


def resume(
    checkpointer: Checkpointer, train: TrainConfig, config: ConfigRecord, note: Callable[[str], None]
) -> Resumed | None:
    """Apply ``train.resume`` (every rank); None for a fresh start. ``note`` reports what the user should
    know (checkpoints set aside, a forced resume's new values)."""
    manager, state = checkpointer.manager, checkpointer.train
    set_aside = manager.cleanup_partial().set_aside
    if set_aside:
        note(
            f"{len(set_aside)} checkpoint folder(s) without meta.json (not written by ddp-rank's atomic save: a "
            f"copy cut short?) moved to {set_aside[0].parent}, kept and never resumed from: "
            + ", ".join(p.name for p in set_aside)
        )
    mode = train.resume
    if mode == "never":
        if manager.latest() is not None:
            raise CheckpointError(
                f"{manager.root} already holds checkpoints and train.resume=never: use a new "
                "train.output_dir, delete the old run, or train.resume=auto to continue it"
            )
        return None
    path = (
        _intact_latest(manager.root, note)
        if mode == "auto"
        else verify_checkpoint(resolve_checkpoint(mode, "latest"))
    )
    if path is None:
        return None
    meta = read_meta(path)
    checkpointer.check(path, meta)
    checkpointer.refuse_unsafe_files(path)
    force = train.force_resume
    # Only DeepSpeed's partitioned optimizer state ties a checkpoint to its world size: the data plan does not.
    check_world_size(meta, state.world_size, force or not checkpointer.deepspeed, str(path))
    # The saved weights' shapes as well: not every shape is a model.* key (a ViT's position embeddings follow
    # data.image_size), and load_state would fail on them with a bare size-mismatch traceback.
    model = getattr(checkpointer.model, "module", checkpointer.model)
    changes = resume_changes(meta, config, state.total_steps) + tensor_changes(path, model)
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
        report = init_from(model, path)
        note(
            f"forced resume from {path} with a changed model or optimizer: the optimizer state and RNG are "
            f"not restored.\n{report.summary()}"
        )
    else:
        checkpointer.load_files(path)
    checkpointer.load_meta(meta, force)
    settings = [c for c in changes if not c.is_tensor]  # tensors of another shape are in init_from's report
    if settings:
        note(f"forced resume from {path}: the new values apply: {describe_changes(settings)}")
    if mode != "auto" and manager.root.parent.resolve() not in path.resolve().parents:
        note(
            f"continuing {mode} at step {state.step} with its optimizer state (train.resume); to start from "
            "its weights only, use model.init_from"
        )
    _abandon_later_checkpoints(checkpointer, meta, train.best_metric, note)
    return Resumed(path, changes)


def _intact_latest(root: Path, note: Callable[[str], None]) -> Path | None:
    """The newest checkpoint under ``root`` whose files are intact (``model.checkpoint_read``), each newer,
    damaged one noted in one line; it is moved aside with the other later checkpoints once the resume is done
    (:func:`_abandon_later_checkpoints`). Every rank checks (each reads the files it loads anyway)."""
    path, damaged = newest_intact_checkpoint(root)
    if damaged and path is None:
        newest, problem = damaged[0]
        raise CheckpointError(
            f"checkpoint {newest} is damaged ({problem}) and no earlier checkpoint of the run is intact: restore "
            f"the files from a copy, or move {root} aside to start afresh"
        )
    for bad, problem in damaged:
        note(f"checkpoint {bad} is damaged ({problem}): continuing from {path} instead")
    return path


def _abandon_later_checkpoints(
    checkpointer: Checkpointer, meta: dict[str, Any], best_metric: str, note: Callable[[str], None]
) -> None:
    """A rewind (this run continues at step s while its output_dir holds checkpoints after s, e.g. resumed
    from an earlier one after a divergence): move those aside, as metrics.jsonl is cut back to s, so that the
    next ``train.resume=auto`` continues this timeline, not the abandoned one. Collective (all ranks)."""
    best = None
    if meta.get("best_step") is not None and meta.get("best_value") is not None:
        metric = str(meta.get("best_metric", best_metric))
        best = (int(meta["best_step"]), metric, float(meta["best_value"]))
    step = checkpointer.train.step
    folder, moved = checkpointer.manager.abandon_after(step, best)
    if folder is not None:
        note(
            f"rewound to step {step}: the later checkpoints of this run ({', '.join(moved)}) were moved to "
            f"{folder} so that train.resume=auto continues from here; delete that folder once you no longer "
            "need them"
        )
