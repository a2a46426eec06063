"""Embeddings of a whole collection with their keys, labels and categories, as numpy ``.npz`` files.

Layout of an export directory (one part per rank, so a large collection is embedded and written by every rank
in parallel and no rank holds more than its share)::

    export.json                    what was embedded (source, checkpoint, model), the parts and their row counts
    part-00000-of-00002.npz        embeddings [n, d] float32, keys [n] str, labels [n] int64 (-1: none),
    part-00001-of-00002.npz        categories [n] str, subsets [n] str

``load_export`` concatenates the parts in rank order. ``export.json`` is written last, by rank 0, once every
part is complete: a directory without it is not an export.
"""

from __future__ import annotations

import json
import os
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

__all__ = [
    "EXPORT_MANIFEST",
    "Embeddings",
    "embed_batches_to_arrays",
    "load_export",
    "part_name",
    "save_export",
]

EXPORT_MANIFEST = "export.json"


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
            parts.append({"file": part_name(r, world), "rows": int(f["embeddings"].shape[0])})
            dim = int(f["embeddings"].shape[1])
    manifest = {"format": "ddp_rank-embeddings", "version": 1, "rows": sum(int(p["rows"]) for p in parts),
                "dim": dim, "parts": parts, **meta}  # fmt: skip
    atomic_write_text(root / EXPORT_MANIFEST, json.dumps(manifest, indent=1) + "\n")
    return manifest


def save_export(data: Embeddings, out_dir: str | os.PathLike[str]) -> Path:
    """Write ``data`` as a one-part export directory (for embeddings computed in your own code)."""
    write_part(out_dir, 0, 1, data)
    write_manifest(out_dir, 1, data.meta)
    return Path(out_dir)


def load_export(path: str | os.PathLike[str]) -> Embeddings:
    """Read an export directory (or its ``export.json``): all parts, concatenated in rank order."""
    root = Path(path)
    if root.name == EXPORT_MANIFEST:
        root = root.parent
    manifest_path = root / EXPORT_MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"'{path}' is not an export (no {EXPORT_MANIFEST}): create one with `ddp-rank export`, or it is still "
            "being written"
        )
    manifest = json.loads(manifest_path.read_text())
    arrays: dict[str, list[np.ndarray]] = {
        k: [] for k in ("embeddings", "keys", "labels", "categories", "subsets")
    }
    for part in manifest["parts"]:
        with np.load(root / part["file"]) as f:
            for k in arrays:
                arrays[k].append(f[k])
    meta = {k: v for k, v in manifest.items() if k not in ("parts",)}
    return Embeddings(**{k: np.concatenate(v) for k, v in arrays.items()}, meta=meta)
