"""Embeddings of a whole collection with their keys, labels and categories, as numpy ``.npz`` files.

Layout of an export directory (one part per rank, so a large collection is embedded and written by every rank
in parallel and no rank holds more than its share)::

    export.json                    what was embedded (source, checkpoint, model), the parts and their row counts
    part-00000-of-00002.npz        embeddings [n, d] float32, keys [n] str, labels [n] int64 (-1: none),
    part-00001-of-00002.npz        categories [n] str, subsets [n] str

``load_export`` concatenates the parts in rank order. ``export.json`` is written last, by rank 0, once every
part is complete: a directory without it is not an export. It records each part's size and SHA-256, and
``load_export`` compares them before numpy opens a part (an export of an older version, without them: the part
must open and hold the five arrays); a missing, cut or changed part is refused in one line that names it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.eval.embed import autocast
from ddp_rank.eval.sources import ImageBatch
from ddp_rank.file_checks import file_digest, size_problem

__all__ = [
    "EXPORT_MANIFEST",
    "Embeddings",
    "ExportError",
    "embed_batches_to_arrays",
    "load_export",
    "part_name",
    "read_json_file",
    "save_export",
]

EXPORT_MANIFEST = "export.json"
ARRAYS = ("embeddings", "keys", "labels", "categories", "subsets")
PART_RE = re.compile(r"^part-\d{5}-of-\d{5}\.npz$")


class ExportError(ValueError):
    """An export (or an index's ``items/``) that cannot be read: the message names the file and the fix."""


@dataclass
class Embeddings:
    """An embedded collection: ``embeddings [N, d]`` float32 and per row its key, label, category, subset."""

    embeddings: np.ndarray
    keys: np.ndarray
    labels: np.ndarray
    categories: np.ndarray
    subsets: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.embeddings)
        if not all(len(a) == n for a in (self.keys, self.labels, self.categories, self.subsets)):
            raise ValueError("embeddings, keys, labels, categories and subsets must have the same length")

    def __len__(self) -> int:
        return len(self.embeddings)

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])


def part_name(rank: int, world: int) -> str:
    return f"part-{rank:05d}-of-{world:05d}.npz"


@torch.no_grad()
def embed_batches_to_arrays(
    model: nn.Module,
    batches: Iterable[ImageBatch],
    dim: int,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> Embeddings:
    """Embed ``batches`` in eval mode (train/eval mode restored); ``dim`` gives an empty result its width."""
    was_training = model.training
    model.eval()
    device = torch.device(device)
    embs: list[np.ndarray] = []
    keys: list[str] = []
    labels: list[int] = []
    cats: list[str] = []
    subsets: list[str] = []
    try:
        for b in batches:
            with autocast(device, autocast_dtype):
                e = model(b.images.to(device, non_blocking=True))
            embs.append(e.float().cpu().numpy())
            keys += b.keys
            labels += b.labels
            cats += b.categories
            subsets += b.subsets
    finally:
        model.train(was_training)
    return Embeddings(
        embeddings=np.concatenate(embs) if embs else np.zeros((0, dim), dtype=np.float32),
        keys=np.array(keys, dtype=str),
        labels=np.array(labels, dtype=np.int64),
        categories=np.array(cats, dtype=str),
        subsets=np.array(subsets, dtype=str),
    )


def _write_part(path: Path, data: Embeddings) -> None:
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(
        tmp,
        embeddings=data.embeddings.astype(np.float32),
        keys=data.keys,
        labels=data.labels,
        categories=data.categories,
        subsets=data.subsets,
    )
    os.replace(tmp, path)


def write_part(out_dir: str | os.PathLike[str], rank: int, world: int, data: Embeddings) -> Path:
    """Write this rank's part (atomically: a reader never sees half a file)."""
    path = Path(out_dir) / part_name(rank, world)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_part(path, data)
    return path


def write_manifest(out_dir: str | os.PathLike[str], world: int, meta: dict[str, Any]) -> dict[str, Any]:
    """After every part is written: ``export.json`` with the parts, their row counts and ``meta``."""
    root = Path(out_dir)
    parts: list[dict[str, Any]] = []
    dim = None
    for r in range(world):
        with np.load(root / part_name(r, world)) as f:
            rows, dim = (int(n) for n in f["embeddings"].shape)
        parts.append({"file": part_name(r, world), "rows": rows, **file_digest(root / part_name(r, world))})
    manifest = {
        "format": "ddp_rank-embeddings",
        "version": 1,
        "rows": sum(int(p["rows"]) for p in parts),
        "dim": dim,
        "parts": parts,
        **meta,
    }
    atomic_write_text(root / EXPORT_MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def save_export(data: Embeddings, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``data`` as a one-part export directory (for embeddings computed in your own code)."""
    write_part(out_dir, 0, 1, data)
    write_manifest(out_dir, 1, data.meta)
    return Path(out_dir)


def load_export(path: str | os.PathLike[str]) -> Embeddings:
    """Read an export directory (or its ``export.json``): all parts, checked, concatenated in rank order."""
    root = Path(path)
    if root.name == EXPORT_MANIFEST:
        root = root.parent
    manifest_path = root / EXPORT_MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"'{path}' is not an export (no {EXPORT_MANIFEST}): create one with `ddp-rank export`, or it is still "
            "being written"
        )
    manifest = _read_manifest(manifest_path)
    arrays: dict[str, list[np.ndarray]] = {k: [] for k in ARRAYS}
    for part in manifest["parts"]:
        for k, a in _read_part(root, part).items():
            arrays[k].append(a)
    meta = {k: v for k, v in manifest.items() if k not in ("parts",)}
    if not manifest["parts"]:
        raise ExportError(f"{manifest_path} lists no part: export again with `ddp-rank export`")
    try:
        return Embeddings(**{k: np.concatenate(v) for k, v in arrays.items()}, meta=meta)
    except ValueError as exc:
        raise ExportError(
            f"{root}: the parts do not fit together ({exc}); export again with `ddp-rank export`"
        ) from exc


_AGAIN = "export again with `ddp-rank export` (an index: build it again with `ddp-rank index`)"


def read_json_file(path: Path, fix: str) -> Any:
    """The JSON in ``path``; an :class:`ExportError` naming it as damaged, with ``fix``, where it cannot be read
    or parsed."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ExportError(f"{path} is damaged (not JSON: {str(exc).splitlines()[0]}); {fix}") from exc


def _read_manifest(path: Path) -> dict[str, Any]:
    """``export.json``, checked: an object whose ``parts`` are plain part names in this folder with rows."""
    manifest = read_json_file(path, _AGAIN)
    parts = manifest.get("parts") if isinstance(manifest, dict) else None
    if not isinstance(parts, list) or not all(
        isinstance(p, dict)
        and isinstance(p.get("file"), str)
        and PART_RE.match(p["file"])  # a plain name: nothing outside the folder is read
        and isinstance(p.get("rows"), int)
        and p["rows"] >= 0
        for p in parts
    ):
        raise ExportError(f"{path} is damaged (no list of parts with their file and rows); {_AGAIN}")
    return manifest


def _read_part(root: Path, part: dict[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of one part, after its size and digest (when recorded) match ``export.json``."""
    path = root / part["file"]
    if isinstance(part.get("bytes"), int) and isinstance(part.get("sha256"), str):
        problem = size_problem(path, part["bytes"])
        if problem is None and file_digest(path)["sha256"] != part["sha256"]:
            problem = f"{path.name} does not match the SHA-256 recorded in {EXPORT_MANIFEST}"
        if problem is not None:
            raise ExportError(f"{root}: {problem}; {_AGAIN}")
    elif not path.is_file():
        raise ExportError(f"{root}: {path.name} is missing; {_AGAIN}")
    try:
        with np.load(path) as f:
            arrays = {k: f[k] for k in ARRAYS}
    except Exception as exc:  # numpy / zipfile raise many kinds for a damaged .npz
        raise ExportError(
            f"{root}: {path.name} cannot be read ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            f"; {_AGAIN}"
        ) from exc
    n = part["rows"]
    e = arrays["embeddings"]
    if (
        e.ndim != 2
        or len(e) != n
        or any(a.ndim != 1 or len(a) != n for k, a in arrays.items() if k != "embeddings")
    ):
        raise ExportError(f"{root}: {path.name} does not hold {n} rows as {EXPORT_MANIFEST} says; {_AGAIN}")
    return arrays
