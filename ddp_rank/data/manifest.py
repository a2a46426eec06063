"""The shard-set format: ``manifest.json`` and the layout of a shard directory.

A shard directory holds one ``manifest.json`` and, per split, WebDataset tar shards under ``<split>/``. Every
shard holds ONE category (or only unlabelled classes) and whole classes, stored contiguously; that is what lets
the stream give each rank a disjoint share of a category without reading other categories. Each sample is the
members ``<key>.<jpg|png|webp>``, ``<key>.cls`` (global class id as text) and ``<key>.json`` (class, category,
source path, optional subset such as In-Shop's query/gallery). The manifest is the single source of truth for
counts and checksums; the readers never need to list the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "ddp_rank-shards"
FORMAT_VERSION = 1
IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "png", "webp")
"""Image members the readers decode. Nothing else is ever decoded except ``.cls`` text and ``.json``."""


@dataclass(frozen=True)
class ClassInfo:
    """One class: its global id (index in ``Manifest.classes``), name and category id (None: unlabelled)."""

    id: int
    name: str
    category: int | None


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard. ``classes`` lists ``(class_id, count)`` in the order the classes are stored."""

    path: str
    category: int | None
    classes: tuple[tuple[int, int], ...]
    samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SplitInfo:
    """The shards of one split and its per-class image counts."""

    name: str
    class_counts: dict[int, int]
    shards: tuple[ShardInfo, ...]

    @property
    def samples(self) -> int:
        return sum(s.samples for s in self.shards)


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs about a shard directory; ``root`` is where the manifest was loaded from."""

    categories: tuple[str, ...]
    classes: tuple[ClassInfo, ...]
    splits: dict[str, SplitInfo]
    build: dict[str, Any] = field(default_factory=dict)
    root: Path | None = None

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise KeyError(f"split {name!r} is not in the manifest; it has {sorted(self.splits)}")
        return self.splits[name]

    def shard_path(self, shard: ShardInfo) -> Path:
        if self.root is None:
            raise ValueError("manifest has no root directory; load it with Manifest.load(directory)")
        return self.root / shard.path

    def category_name(self, category: int | None) -> str:
        return "(unlabelled)" if category is None else self.categories[category]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "categories": list(self.categories),
            "classes": [asdict(c) for c in self.classes],
            "splits": {
                name: {
                    "classes": [{"id": cid, "count": n} for cid, n in sorted(split.class_counts.items())],
                    "shards": [
                        {**asdict(s), "classes": [list(pair) for pair in s.classes]} for s in split.shards
                    ],
                }
                for name, split in sorted(self.splits.items())
            },
            "build": self.build,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], root: Path | None = None) -> Manifest:
        if data.get("format") != FORMAT_NAME or data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"not a {FORMAT_NAME} v{FORMAT_VERSION} manifest (format={data.get('format')!r}, "
                f"version={data.get('version')!r}); rebuild the shards with `ddp-rank shards build`"
            )
        splits = {}
        for name, raw in data["splits"].items():
            shards = tuple(
                ShardInfo(
                    path=s["path"],
                    category=s["category"],
                    classes=tuple((int(c), int(n)) for c, n in s["classes"]),
                    samples=int(s["samples"]),
                    bytes=int(s["bytes"]),
                    sha256=s["sha256"],
                )
                for s in raw["shards"]
            )
            counts = {int(c["id"]): int(c["count"]) for c in raw["classes"]}
            splits[name] = SplitInfo(name=name, class_counts=counts, shards=shards)
        return cls(
            categories=tuple(data["categories"]),
            classes=tuple(ClassInfo(**c) for c in data["classes"]),
            splits=splits,
            build=dict(data.get("build", {})),
            root=root,
        )

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> Manifest:
        root = Path(directory)
        path = root / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: is {root} a shard directory made by `ddp-rank shards build`?"
            )
        with path.open(encoding="utf-8") as f:
            return cls.from_json(json.load(f), root=root)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write atomically (temporary name, then rename) so a crash never leaves a half manifest."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.partial")
        tmp.write_text(json.dumps(self.to_json(), indent=1, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
