"""The shard-set format: ``manifest.json`` and the layout of a shard directory (local or behind a URL).

A shard directory holds one ``manifest.json`` and, per split, WebDataset tar shards under ``<split>/``. Every
shard holds ONE category (or only unlabelled classes) and whole classes, stored contiguously, so a class is ONE
byte range of one tar: the manifest records, per class, its offset, length and a digest of those bytes, and the
training stream reads a class with a single ranged read (no header walk, any storage fsspec can reach). Shards
made by other tools and indexed in place (``ddp-rank shards index``) may hold a class as several spans, in one
shard or across shards (shuffled samples, ``maxcount`` cuts, interleaved classes), and mix categories in a shard
(its ``category`` is then null); the stream reads such a class with one request per span. Each
sample is the members ``<key>.<jpg|jpeg|png|webp>``, ``<key>.cls`` (global class id as text) and ``<key>.json``
(class, category, source path, optional subset such as In-Shop's query/gallery). The manifest is the single
source of truth for counts, ranges and checksums; readers never list the directory. It is parsed and checked
in one place, ``manifest_check`` (``Manifest.load`` / ``from_json``), and a shard path is confined to the shard
root again wherever it is resolved for reading (``Manifest.shard_url``, ``confined_join``).

The records a manifest is made of (``ClassSpan``, ``ShardInfo``, ...) and the location helpers live in
``manifest_parts``, below the parsing; they are imported here too, so ``ddp_rank.data.format.manifest`` names
the whole format.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_rank.data.format.manifest_check import parse_manifest
from ddp_rank.data.format.manifest_parts import (
    FORMAT_NAME,
    FORMAT_VERSION,
    IMAGE_EXTENSIONS,
    MANIFEST_NAME,
    PAYLOAD_EXTENSIONS,
    SPAN_DIGEST,
    SPLIT_NAME_RULE,
    ClassInfo,
    ClassSpan,
    ManifestError,
    ShardInfo,
    SplitInfo,
    confined_join,
    is_url,
    join_location,
    read_location,
    sha256_file,
    shard_path_problem,
    span_digest,
    span_hasher,
    split_name_problem,
)
from ddp_rank.data.format.no_manifest import no_manifest_advice

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "IMAGE_EXTENSIONS",
    "MANIFEST_NAME",
    "PAYLOAD_EXTENSIONS",
    "SPAN_DIGEST",
    "SPLIT_NAME_RULE",
    "ClassInfo",
    "ClassSpan",
    "Manifest",
    "ManifestError",
    "ShardInfo",
    "SplitInfo",
    "confined_join",
    "is_url",
    "join_location",
    "read_location",
    "sha256_file",
    "shard_path_problem",
    "span_digest",
    "span_hasher",
    "split_name_problem",
]


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs about a shard directory; ``root`` is where the manifest was loaded from.

    Examples:
        Shards of a folder of images (``root/<category>/<class>/<image>``), and what their manifest says:

        >>> import tempfile
        >>> from pathlib import Path
        >>> from PIL import Image
        >>> from ddp_rank.data import BuildOptions, Manifest, build_shards, read_image_folder
        >>> root = Path(tempfile.mkdtemp())
        >>> for category, product, view in [(c, p, v) for c in ("mugs", "lamps") for p in (0, 1) for v in (0, 1, 2)]:
        ...     folder = root / "images" / category / f"{category}-{product}"
        ...     folder.mkdir(parents=True, exist_ok=True)
        ...     Image.new("RGB", (8, 8), (40 * product, 80 * view, 0)).save(folder / f"{view}.png")
        >>> _ = build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
        >>> manifest = Manifest.load(root / "shards")
        >>> manifest.categories, [c.name for c in manifest.classes]
        (('lamps', 'mugs'), ['lamps-0', 'lamps-1', 'mugs-0', 'mugs-1'])
        >>> manifest.split("train").class_counts  # class id -> images
        {0: 3, 1: 3, 2: 3, 3: 3}
    """

    categories: tuple[str, ...]
    classes: tuple[ClassInfo, ...]
    splits: dict[str, SplitInfo]
    build: dict[str, Any] = field(default_factory=dict)
    root: str | None = None
    """Directory or URL the manifest was loaded from."""
    shards_root: str | None = None
    """Where the shard paths are relative to, when not beside the manifest: a local manifest can describe
    shards on object storage (``ddp-rank shards index URL --out DIR``)."""
    shared_classes: str | None = None
    """Why the splits may share classes (``--shared-classes REASON``); None: a class of the ``train`` split in
    another split is a leak (``class_leaks``)."""

    def split(self, name: str) -> SplitInfo:
        if name not in self.splits:
            raise KeyError(f"split {name!r} is not in the manifest; it has {sorted(self.splits)}")
        return self.splits[name]

    def shard_path(self, shard: ShardInfo) -> Path:
        """The local path of a shard (only for shards on this machine's file system; see ``location``)."""
        if is_url(self.location):
            raise ValueError(
                f"{self.location} is a URL, not a local directory; read it through ddp_rank.data.reading.storage"
            )
        return Path(self.shard_url(shard))

    @property
    def location(self) -> str:
        """The directory or URL the shard paths are relative to."""
        base = self.shards_root or self.root
        if base is None:
            raise ValueError("manifest has no root directory; load it with Manifest.load(directory)")
        return base

    def shard_url(self, shard: ShardInfo) -> str:
        """Where a shard lives: a local path or a URL (``location`` joined with the shard's relative path).

        Every read of a shard resolves its path here, so the path is confined here again although the loader
        refused unsafe paths already: a ``Manifest`` built in code never went through the loader."""
        return confined_join(self.location, shard.path)

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
                        {**asdict(s), "classes": [_span_row(c) for c in s.classes]} for s in split.shards
                    ],
                }
                for name, split in sorted(self.splits.items())
            },
            "build": self.build,
            **({"shards_root": self.shards_root} if self.shards_root else {}),
            **({"shared_classes": self.shared_classes} if self.shared_classes else {}),
        }

    @classmethod
    def from_json(cls, data: Any, root: str | os.PathLike[str] | None = None) -> Manifest:
        """The manifest of ``data`` (parsed JSON), every field checked (``manifest_check``); raises
        ``ManifestError`` naming the field."""
        location = None if root is None else os.fspath(root)
        return cls(**parse_manifest(data, location)._asdict(), root=location)

    @classmethod
    def load(cls, location: str | os.PathLike[str]) -> Manifest:
        """Load ``<location>/manifest.json``; ``location`` is a directory or a URL (http(s), s3, gs, ...)."""
        root = os.fspath(location).rstrip("/") or "/"
        path = join_location(root, MANIFEST_NAME)
        try:
            raw = read_location(path)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{path} not found: {no_manifest_advice(root)}") from exc
        except OSError as exc:  # a directory in its place, no permission, an I/O error
            raise ManifestError(f"{path}: cannot be read ({exc.strerror or exc}); {_FIX_READ}") from exc
        return cls.from_json(_decode_json(raw, path), root=root)

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write atomically (temporary name, then rename) so a crash never leaves a half manifest."""
        path = Path(directory) / MANIFEST_NAME
        tmp = path.with_name(f".{MANIFEST_NAME}.partial")
        # Indented for reading by eye; compact for big sets (200,000 classes load in a fraction of a second).
        indent = 1 if len(self.classes) <= 20_000 else None
        tmp.write_text(json.dumps(self.to_json(), indent=indent, sort_keys=False) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path


_FIX_READ = "check the file, or rebuild it with `ddp-rank shards build` (`ddp-rank shards index` for other tools' shards)"


def _decode_json(raw: bytes, path: str) -> Any:
    """The parsed JSON of the manifest file ``path``, or a ``ManifestError`` that names it."""
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{path}: not UTF-8 text (byte {exc.start}); {_FIX_READ}") from exc
    except json.JSONDecodeError as exc:
        raise ManifestError(
            f"{path}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {_FIX_READ}"
        ) from exc
    # A number of over 4,300 digits (ValueError), nesting deeper than the interpreter's stack (RecursionError).
    except (ValueError, RecursionError) as exc:
        raise ManifestError(
            f"{path}: not a manifest's JSON ({type(exc).__name__}: {exc}); {_FIX_READ}"
        ) from exc


def _span_row(span: ClassSpan) -> list[int | str]:
    """A span as a compact JSON row ``[id, count, offset, length, digest]`` (manifests of 200k classes)."""
    return [span.id, span.count, span.offset, span.length, span.digest]
