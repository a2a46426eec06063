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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "ddp_rank-shards"
FORMAT_VERSION = 2
SPAN_DIGEST = "blake2b-128"
"""Digest of a class's byte range (``ClassSpan.digest``): ``span_digest``, ``hashlib.blake2b`` of 16 bytes."""
IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
"""Image members the readers decode. Nothing else is ever decoded except ``.cls`` text and ``.json``."""
PAYLOAD_EXTENSIONS: tuple[str, ...] = (*IMAGE_EXTENSIONS, "f16")
"""The member that makes a sample: an image, or a feature vector (``features.records``: raw float16 bytes)."""

_UNSAFE_PATH_CHARACTERS = frozenset("\\:%?#") | frozenset(map(chr, range(32))) | {"\x7f"}
"""Characters refused in a shard path: a backslash or a colon (another separator, a drive or a scheme), and
``%``, ``?``, ``#`` and control characters, which change what a path means once joined to a URL."""


class ManifestError(ValueError):
    """A manifest, or a path in it, that cannot be trusted: the message names the file, the field as a JSON
    path (``splits.train.shards[3].path``), the problem and the fix."""


def shard_path_problem(path: str) -> str | None:
    """Why ``path`` (a shard path from a manifest) could leave the shard root, or None when it stays inside:
    it must be relative, ``/``-separated, with no empty, ``.`` or ``..`` segment and no character of
    ``_UNSAFE_PATH_CHARACTERS`` (the rules of ``tarfile``'s extraction filters, PEP 706, for archive names)."""
    if not path:
        return "is empty"
    if path.startswith("/"):
        return "is absolute"
    bad = sorted({c for c in path if c in _UNSAFE_PATH_CHARACTERS})
    if bad:
        return f"holds {', '.join(repr(c) for c in bad)} (no scheme, drive, host or escape is allowed)"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "has an empty, '.' or '..' segment"
    return None


_SPLIT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
SPLIT_NAME_RULE = "letters, digits, '_', '.' and '-', not starting with '.' or '-'"
"""What a split name may be: it names the folder ``<split>/`` its shards are written to, so it must be one safe
path segment (no ``/``, no ``..``)."""


def split_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a split name (it would not be one folder inside the shard directory), or None."""
    if _SPLIT_NAME.fullmatch(name) is None or name in (".", ".."):
        return f"split name {name!r} is not allowed: use {SPLIT_NAME_RULE}"
    return None


def span_hasher() -> Any:
    """A fresh SPAN_DIGEST hash (the shard writer feeds it a class's bytes as it writes them)."""
    return hashlib.blake2b(digest_size=16)


def span_digest(data: bytes | memoryview) -> str:
    """The SPAN_DIGEST of a class's byte range, as the manifest stores it."""
    hasher = span_hasher()
    hasher.update(data)
    return str(hasher.hexdigest())


@dataclass(frozen=True)
class ClassInfo:
    """One class: its global id (index in ``Manifest.classes``), name and category id (None: unlabelled)."""

    id: int
    name: str
    category: int | None


@dataclass(frozen=True)
class ClassSpan:
    """Where (part of) a class lies in its shard: ``count`` samples in ``[offset, offset + length)`` of the tar,
    from the first header of its first member to the end of its last member's data padding. A class has one span
    in ddp_rank's own shards and may have several in shards indexed in place; its count in a split is the sum of
    its spans' counts. ``digest`` (SPAN_DIGEST) of
    those bytes lets a reader reject a corrupt or stale range without reading the rest of the shard."""

    id: int
    count: int
    offset: int
    length: int
    digest: str

    def __iter__(self) -> Iterator[int]:
        """``class_id, count = span`` (the pair most callers need)."""
        return iter((self.id, self.count))


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard. ``classes`` lists its ``ClassSpan``s in the order the classes are stored."""

    path: str
    category: int | None
    classes: tuple[ClassSpan, ...]
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
    root: str | None = None
    """Directory or URL the manifest was loaded from."""
    shards_root: str | None = None
    """Where the shard paths are relative to, when not beside the manifest: a local manifest can describe
    shards on object storage (``ddp-rank shards index URL --out DIR``)."""

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
        }

    @classmethod
    def from_json(cls, data: Any, root: str | os.PathLike[str] | None = None) -> Manifest:
        """The manifest of ``data`` (parsed JSON), every field checked (``manifest_check``); raises
        ``ManifestError`` naming the field."""
        from ddp_rank.data.format.manifest_check import parse_manifest  # it builds this module's classes

        return parse_manifest(data, None if root is None else os.fspath(root))

    @classmethod
    def load(cls, location: str | os.PathLike[str]) -> Manifest:
        """Load ``<location>/manifest.json``; ``location`` is a directory or a URL (http(s), s3, gs, ...)."""
        root = os.fspath(location).rstrip("/") or "/"
        path = join_location(root, MANIFEST_NAME)
        try:
            raw = read_location(path)
        except FileNotFoundError as exc:
            from ddp_rank.data.building.shard_sources import (
                no_manifest_advice,  # it reads this module's helpers
            )

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


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` locations (fsspec protocols); plain paths and ``file://`` are local."""
    text = os.fspath(location)
    return "://" in text and not text.startswith("file://")


def read_location(path: str) -> bytes:
    """The bytes of a local file or of a URL (fsspec); ``OSError`` (``FileNotFoundError`` when absent) else."""
    if is_url(path):
        import fsspec  # imported here: the shard tools that never see a URL need not pay for it

        with fsspec.open(path, "rb") as f:
            data: bytes = f.read()
        return data
    return Path(path).read_bytes()


def join_location(root: str | os.PathLike[str], relative: str) -> str:
    """``root/relative`` for a directory or a URL (URLs always join with ``/``)."""
    text = os.fspath(root)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if is_url(text):
        return f"{text.rstrip('/')}/{relative}"
    return str(Path(text) / relative)


def confined_join(root: str | os.PathLike[str], relative: str) -> str:
    """``join_location(root, relative)``, refused with ``ManifestError`` when the result would lie outside
    ``root``: ``relative`` must pass ``shard_path_problem``, and the joined path must still start with ``root``."""
    problem = shard_path_problem(relative)
    base = os.fspath(root)
    joined = join_location(base, relative)
    if problem is None:
        if is_url(base):
            inside = joined.startswith(base.rstrip("/") + "/")
        else:
            local = base[len("file://") :] if base.startswith("file://") else base
            top = os.path.normpath(local)
            inside = os.path.commonpath([top, os.path.normpath(joined)]) == top
        problem = None if inside else "resolves outside the shard root"
    if problem is not None:
        raise ManifestError(
            f"shard path {relative!r} {problem}: shard paths are relative to {base} and stay inside it; move "
            "the shard there and record its relative path"
        )
    return joined


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()
