"""The pieces a shard set's description is made of, below both the ``Manifest`` and its checked parsing.

The format's constants, the manifest's error, the rules a shard path and a split name follow, the span digest,
the records of a class, a span, a shard and a split, and the joining and reading of locations (a directory or a
URL). ``manifest_check`` builds these from untrusted JSON and ``manifest`` assembles them into a ``Manifest``;
both import this module and neither imports the other's caller, so the parsing needs no deferred import.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "ddp_rank-shards"
FORMAT_VERSION = 2
SPAN_DIGEST = "blake2b-128"
"""Digest of a class's byte range (``ClassSpan.digest``): ``span_digest``, ``hashlib.blake2b`` of 16 bytes."""
IMAGE_EXTENSIONS: tuple[str, ...] = ("jpg", "jpeg", "png", "webp")
"""Image members the readers decode. Nothing else is ever decoded except ``.cls`` text and ``.json``."""
PAYLOAD_EXTENSIONS: tuple[str, ...] = (*IMAGE_EXTENSIONS, "f16")
"""The member that makes a sample: an image, or a feature vector (``data.features.records``: float16 bytes)."""

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
    with open(path, "rb") as f:
        return sha256_stream(f, chunk)


def sha256_stream(f: BinaryIO, chunk: int = 1 << 20) -> str:
    """The sha256 of an open binary file's whole content, read from its start in ``chunk``-byte blocks."""
    digest = hashlib.sha256()
    f.seek(0)
    while block := f.read(chunk):
        digest.update(block)
    return digest.hexdigest()


_DIGITS = re.compile(r"(\d+)")


def natural_key(text: str) -> tuple[tuple[tuple[int, int | str], ...], str]:
    """Sort key with numbers compared as numbers (class "10" after "9"), so ids follow the dataset's own order;
    then the text itself: "7", "07" and "007" tie as numbers, and sorting a set by the numbers alone would order
    them as the set iterates (which changes with PYTHONHASHSEED)."""
    parts = tuple((0, int(p)) if p.isdigit() else (1, p) for p in _DIGITS.split(text) if p)
    return parts, text
