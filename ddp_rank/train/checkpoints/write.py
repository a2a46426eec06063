"""Writing atomic checkpoints: keep the last K and the best, rotate, abandon a rewound timeline.

Reading them (``read_meta``, ``resolve_checkpoint``, ``load_model_weights``) lives in ``model.checkpoint_read``,
which evaluation and export share.

Layout under ``<output_dir>/checkpoints/``::

    step-00000120/          one complete checkpoint (whatever the save function writes: with accelerate, the
        meta.json           model, optimizer, scaler, per-rank RNG; the trainer's scheduler.json and
                            loss_state.safetensors, ``state_files``) + meta.json, written LAST, with
                            the size and SHA-256 of every other file (``files``: what readers check first)
    .tmp-step-00000160/     a checkpoint being written (ignored, removed at the next start)
    .tmp-trash-step-*/      a checkpoint being deleted (ignored, removed at the next start)
    best.json               {"step": 120, "metric": "recall@1", "value": 0.41}
    abandoned-<time>/       checkpoints of a later timeline, moved aside when a run was rewound (never read)
    incomplete-<time>/      step-* folders without meta.json, which this writer never leaves (a copy cut short,
                            another tool's files), moved aside at the next start, never deleted (never read)

Why directory rename: every rank writes into the temporary directory, all ranks meet at a barrier, then rank 0
fsyncs the files, writes ``meta.json``, and renames the directory into place with ``os.replace`` (atomic on
POSIX) and fsyncs the parent. A kill at any moment therefore leaves either the previous complete checkpoints or
the new one, never a half-written ``step-*`` directory. A checkpoint counts only if it has its ``meta.json``.
Deleting one (rotation, or a step written again) renames it to a ``.tmp-trash-`` name first, for the same reason.
The checkpoint directory must be on a file system that every rank sees (the usual shared run directory).

Rewinding (resuming at step s while checkpoints of later steps exist, e.g. from an earlier checkpoint after a
divergence) abandons those later checkpoints: :meth:`CheckpointManager.abandon_after` moves them, and a
``best.json`` naming one of them, into ``abandoned-<time>/``, so that the next ``train.resume=auto`` continues the
new timeline and not the abandoned one.

Resume with another world size is refused unless forced: the data stream gives every rank its share of each
step's categories, so with a different world size the remaining steps would see different samples (and the
per-rank RNG states would not line up), and the run would no longer continue the one that was interrupted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from ddp_rank.atomic_io import atomic_write_text, follow_umask, fsync_dir, fsync_tree
from ddp_rank.file_checks import digest_files
from ddp_rank.model.checkpoint_read import (
    BEST_NAME,
    FILES_KEY,
    META_NAME,
    STEP_RE,
    CheckpointError,
    complete_checkpoints,
    latest_checkpoint,
    read_best,
)

__all__ = ["CheckpointManager", "check_world_size"]


def check_world_size(meta: dict[str, Any], world_size: int, force: bool, where: str = "") -> None:
    """Refuse to resume a checkpoint written with another number of processes unless ``force`` (the trainer
    forces it except under DeepSpeed, whose optimizer state is partitioned by rank)."""
    saved = int(meta.get("world_size", world_size))
    if saved != world_size and not force:
        raise CheckpointError(
            f"checkpoint {where} was written by {saved} process(es) but this run has {world_size}, and DeepSpeed "
            "partitions the optimizer state by rank. Launch with "
            f"--num_processes {saved}, or pass train.force_resume=true to try anyway."
        )


class Cleanup(NamedTuple):
    """What :meth:`CheckpointManager.cleanup_partial` did: the leftovers of killed saves it deleted, and the
    folders without ``meta.json`` it moved aside (their new paths)."""

    removed: list[Path]
    set_aside: list[Path]


def _new_folder(root: Path, kind: str) -> Path:
    """A new, empty ``<kind>-<time>`` folder under ``root`` (``-2``, ``-3`` ... when that name is taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = root / f"{kind}-{stamp}", 1
    while folder.exists():
        n += 1
        folder = root / f"{kind}-{stamp}-{n}"
    folder.mkdir()
    return folder


class CheckpointManager:
    """Save, list, rotate and find checkpoints under ``root``; rank-0 does the file-system work.

    ``barrier`` is the cross-rank synchronisation (``accelerator.wait_for_everyone``); with one process it can
    be a no-op. ``save_fn(directory)`` is called on every rank and writes the state (``accelerator.save_state``).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        keep_last: int = 3,
        is_main: bool = True,
        barrier: Callable[[], None] = lambda: None,
    ) -> None:
        if keep_last < 1:
            raise ValueError("keep_last must be >= 1")
        self.root = Path(root)
        self.keep_last = keep_last
        self.is_main = is_main
        self.barrier = barrier
        self._last_saved_step: int | None = None

    # -- queries -------------------------------------------------------------------------------------------
    def path_for(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def complete(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first."""
        return complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        return latest_checkpoint(self.root)

    def best(self) -> dict[str, Any] | None:
        """The content of ``best.json`` (step, metric, value, path) if a best checkpoint was recorded."""
        return read_best(self.root)

    # -- writes --------------------------------------------------------------------------------------------
    def cleanup_partial(self) -> Cleanup:
        """Remove what a killed save left (its ``.tmp-`` folders) and move a ``step-*`` folder without
        ``meta.json`` into ``incomplete-<time>/`` (main rank only; all ranks call it); returns both lists.

        Why not delete the latter: the atomic save never leaves one, so such a folder is not ours to throw
        away (a copy of a run that was cut short, files put there by hand). It cannot be resumed from either:
        it goes where :meth:`latest` does not look, and the caller says where."""
        result = Cleanup([], [])
        if self.is_main and self.root.is_dir():
            entries = sorted(self.root.iterdir())
            incomplete = [p for p in entries if STEP_RE.match(p.name) and not (p / META_NAME).is_file()]
            for p in entries:
                if p.name.startswith(".tmp-"):
                    shutil.rmtree(p, ignore_errors=True)
                    result.removed.append(p)
            if incomplete:
                folder = _new_folder(self.root, "incomplete")
                for p in incomplete:
                    os.replace(p, folder / p.name)
                    result.set_aside.append(folder / p.name)
                fsync_dir(self.root)
        self.barrier()
        return result

    @property
    def last_saved_step(self) -> int | None:
        """The step this manager wrote last in this process (None before its first save)."""
        return self._last_saved_step

    def save(self, step: int, meta: dict[str, Any], save_fn: Callable[[Path], None]) -> Path:
        """Write checkpoint ``step`` atomically on all ranks; returns its final path.

        A step saved already by this manager (e.g. at the end of an epoch and again for a new best) is not
        written twice: the state at a given step is the same. The decision uses memory, not the file system,
        so every rank takes it alike (a rank with a stale view of a shared file system must not skip the
        collectives of a save that the others make). A leftover of that step from an earlier run is replaced.
        """
        final = self.path_for(step)
        if step == self._last_saved_step:
            return final
        tmp = self.root / f".tmp-{final.name}"
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self.barrier()
        save_fn(tmp)
        self.barrier()
        if self.is_main:
            follow_umask(tmp)
            fsync_tree(tmp)
            # The record every reader checks the files against; in meta.json, so it is as atomic as the rest.
            files = digest_files(tmp, skip=(META_NAME,))
            atomic_write_text(
                tmp / META_NAME,
                json.dumps({**meta, "step": step, FILES_KEY: files}, indent=1, sort_keys=True) + "\n",
            )
            # A leftover of this step (an earlier timeline) goes to a trash name first: a kill before the new one is
            # in place leaves the older checkpoints, never a step-* that lost part of its files but kept meta.json.
            trash = self._to_trash(final) if final.exists() else None
            os.replace(tmp, final)
            fsync_dir(self.root)
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
            self._rotate()
        self.barrier()
        self._last_saved_step = step
        return final

    def mark_best(self, step: int, metric: str, value: float) -> None:
        """Record checkpoint ``step`` as the best (it must exist); the rotation keeps it."""
        if self.is_main:
            self._write_best(step, metric, value)
            self._rotate()
        self.barrier()

    def _write_best(self, step: int, metric: str, value: float) -> None:
        atomic_write_text(
            self.root / BEST_NAME,
            json.dumps({"step": step, "metric": metric, "value": value, "path": self.path_for(step).name})
            + "\n",
        )

    def _rotate(self) -> None:
        ckpts = self.complete()
        keep = {s for s, _ in ckpts[-self.keep_last :]}
        best = self.best()
        if best is not None:
            keep.add(int(best["step"]))
        for s, p in ckpts:
            if s not in keep:
                # Rename first so that a kill during rmtree never leaves a step-* without its files.
                shutil.rmtree(self._to_trash(p), ignore_errors=True)

    def _to_trash(self, path: Path) -> Path:
        """Rename ``path`` to its ``.tmp-trash-`` name (what :meth:`cleanup_partial` removes); returns that name."""
        trash = self.root / f".tmp-trash-{path.name}"
        if trash.exists():  # left by a kill during an earlier deletion
            shutil.rmtree(trash)
        os.replace(path, trash)
        return trash

    def abandon_after(
        self, step: int, best: tuple[int, str, float] | None = None
    ) -> tuple[Path | None, list[str]]:
        """Move the checkpoints of steps after ``step`` (a run rewound to ``step``) aside; all ranks call it.

        They go, with a ``best.json`` that names one of them, into ``abandoned-<time>/`` under the root, where
        :meth:`latest` and :meth:`complete` no longer see them; nothing is deleted. ``best`` is the resumed
        checkpoint's own best-so-far ``(step, metric, value)``: it becomes ``best.json`` again if that checkpoint
        is still here. The main rank moves after every rank has chosen its checkpoint (a barrier before and
        after), so all ranks see one state. Returns, on the main rank, (the folder, the names moved), and
        (None, []) when nothing was later or on the other ranks.
        """
        self.barrier()
        folder: Path | None = None
        moved: list[str] = []
        if self.is_main and self.root.is_dir():
            later = [p for s, p in self.complete() if s > step]
            recorded = self.best()
            stale_best = recorded is not None and int(recorded["step"]) > step
            if later or stale_best:
                folder = _new_folder(self.root, "abandoned")
                for p in later:
                    os.replace(p, folder / p.name)
                    moved.append(p.name)
                if stale_best:
                    os.replace(self.root / BEST_NAME, folder / BEST_NAME)
                    moved.append(BEST_NAME)
                    if (
                        best is not None
                        and best[0] <= step
                        and (self.path_for(best[0]) / META_NAME).is_file()
                    ):
                        self._write_best(*best)
                fsync_dir(folder)
                fsync_dir(self.root)
        self.barrier()
        return folder, moved
