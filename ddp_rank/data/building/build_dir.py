"""The output directory of ``ddp-rank shards build``: what a build may write into, and what it may replace.

A build never deletes anything it did not write: the checks run before any record is read, and the earlier
build's files are removed only once the new input has passed its checks (``build.build_shards``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from ddp_rank.data.building.listing import ListingError, Record
from ddp_rank.data.format.manifest import MANIFEST_NAME


def check_out_dir(out: Path, records: Sequence[Record], overwrite: bool) -> list[Path]:
    """Refuse an output directory that holds source images, or that is not empty and not an earlier build's
    output; with ``overwrite``, return the files of the earlier build to delete (nothing is deleted here).

    A build writes ``manifest.json`` and ``<split>/<split>-<c0000|unlabelled>-00000.tar`` shards (the manifest
    last, each shard through a ``.<name>.partial`` file). Only such files are ever replaced: anything else found
    in a shard directory stays, and a directory with neither a manifest nor only such files is refused.
    """
    if not out.exists():
        return []
    if not out.is_dir():
        raise NotADirectoryError(f"{out} is a file; choose a directory (new or empty) for the shards")
    entries = sorted(p for p in out.iterdir() if p.name != ".gitkeep")
    if not entries:
        return []
    _refuse_sources_inside(out, records)
    ours, foreign = _build_outputs(entries)
    shard_dir = (out / MANIFEST_NAME).is_file()
    if not shard_dir and foreign:
        shown = ", ".join(str(p.relative_to(out)) for p in foreign[:5])
        if len(foreign) > 5:
            shown += f" and {len(foreign) - 5} more"
        raise FileExistsError(
            f"{out} is not empty and is not a shard directory (no {MANIFEST_NAME}; it holds {shown}); "
            "--overwrite only replaces an earlier build's shards: choose a new or empty directory"
        )
    if not overwrite:
        what = "a shard directory" if shard_dir else "not empty (shards of an unfinished build)"
        raise FileExistsError(
            f"{out} is {what}; choose a new directory or pass --overwrite to replace the earlier build's shards"
        )
    return ours


def _refuse_sources_inside(out: Path, records: Sequence[Record]) -> None:
    """Raise if ``out`` is the folder of a source image or one of its ancestors (real paths, links followed)."""
    root = Path(os.path.realpath(out))
    for folder in sorted({os.path.dirname(r.path) for r in records}):
        real = Path(os.path.realpath(folder or "."))
        if real == root or root in real.parents:
            example = next(r.path for r in records if os.path.dirname(r.path) == folder)
            raise ListingError(
                f"{out} holds source images (such as {example}); write the shards to a directory outside the "
                "image folders"
            )


_SHARD_FILE = r"(?:c\d{4,}|unlabelled)-\d{5,}\.tar"


def _is_shard_file(split: str, name: str) -> bool:
    """Whether ``name`` in folder ``split`` is a shard a build writes there (or its unfinished ``.partial``)."""
    shard = re.escape(split) + "-" + _SHARD_FILE
    return re.fullmatch(shard, name) is not None or re.fullmatch(rf"\.{shard}\.partial", name) is not None


def _build_outputs(entries: Sequence[Path]) -> tuple[list[Path], list[Path]]:
    """Split a directory's entries into files a build writes and anything else (empty folders are neither)."""
    ours: list[Path] = []
    foreign: list[Path] = []
    for entry in entries:
        if entry.is_symlink():
            foreign.append(entry)
        elif entry.name in (MANIFEST_NAME, f".{MANIFEST_NAME}.partial") and entry.is_file():
            ours.append(entry)
        elif entry.is_dir():
            for child in sorted(entry.iterdir()):
                if child.is_file() and not child.is_symlink() and _is_shard_file(entry.name, child.name):
                    ours.append(child)
                else:
                    foreign.append(child)
        else:
            foreign.append(entry)
    return ours, foreign


def remove_stale(out: Path, stale: Sequence[Path]) -> None:
    """Delete an earlier build's files (manifest first, so an interruption never leaves a manifest whose shards
    are gone), then the split folders this emptied; create ``out``."""
    for path in sorted(stale, key=lambda p: p.name != MANIFEST_NAME):
        path.unlink(missing_ok=True)
    for folder in sorted({p.parent for p in stale if p.parent != out}):
        if not any(folder.iterdir()):
            folder.rmdir()
    out.mkdir(parents=True, exist_ok=True)
