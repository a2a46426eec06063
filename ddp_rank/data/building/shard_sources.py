"""Which shards a source names: a directory, a URL, a brace pattern or glob, ``--split NAME=PATTERN`` arguments.

``shards index`` and ``shards reshard`` take their shards from here, so both accept the same sources:

- a local directory: one split per sub-directory holding tars (ddp_rank's own layout), else all its tars as
  ``train``;
- ``--split NAME=PATTERN`` (repeatable): brace ranges such as ``train-{000..099}.tar`` everywhere (a URL cannot be
  listed), ``*`` globs on a local directory;
- a source that names its shards itself (``DIR/data-{000000..000003}.tar``, ``DIR/*.tar``,
  ``https://host/d/train-{000..099}.tar``, one tar file): ``split_source`` cuts it into the directory (up to the
  last ``/`` before the first pattern character) and the pattern of a ``train`` split.

Brace ranges are expanded with ``braceexpand`` (what webdataset expands them with). A brace-expanded name that
is not there is refused naming the first missing file, rather than indexing the rest quietly. Compressed tars
(``compressed``) are found by name when a directory is listed, and refused there with the compression named
(``CompressedShardError``) instead of "no .tar shard found"; one named ``.tar`` is told by its bytes when read.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from pathlib import Path

from braceexpand import braceexpand

from ddp_rank.data.format.compressed import compressed_suffix
from ddp_rank.data.format.manifest_parts import is_url, natural_key, shard_path_problem, split_name_problem
from ddp_rank.data.format.no_manifest import _GLOB, _PATTERN, is_pattern, refuse_compressed

DEFAULT_SPLIT = "train"
"""The split of shards named without one (a pattern as the source, a directory without sub-directories)."""


class ShardIndexError(ValueError):
    """The shards cannot be indexed as they are; the message says why and how to fix it."""


def split_source(source: str | os.PathLike[str]) -> tuple[str, str | None]:
    """(root, pattern): a source naming its shards (a brace pattern, a glob, one tar file, compressed or not) is
    cut at the last ``/`` before its first pattern character (a single file: before its name); a directory (or a
    URL of a directory) is its own root with no pattern."""
    text = os.fspath(source)
    named = is_pattern(text) or (text.lower().endswith(".tar") or compressed_suffix(text) is not None)
    if not named or (not is_url(text) and Path(text).is_dir()):
        return text.rstrip("/") or "/", None
    first = min((i for i, ch in enumerate(text) if ch in _PATTERN), default=len(text))
    cut = text.rfind("/", 0, first)
    if cut < 0:
        return ".", text
    if is_url(text) and cut < text.find("://") + 3:
        raise ShardIndexError(
            f"{text}: name the shards under a folder of the URL, e.g. https://host/d/x-{{0..9}}.tar"
        )
    return text[:cut] or "/", text[cut + 1 :]


def source_splits(
    source: str | os.PathLike[str], patterns: Sequence[str], compressed: bool = False
) -> tuple[str, dict[str, list[str]]]:
    """(root, split -> shard paths relative to it) of ``source`` (``split_source``) and ``--split`` arguments;
    a source that is a pattern is the ``train`` split, and then takes no ``--split``. ``compressed``: as
    ``find_splits``."""
    root, pattern = split_source(source)
    if pattern is None:
        return root, find_splits(root, patterns, compressed)
    if patterns:
        raise ShardIndexError(
            f"{source} names its shards itself: drop --split {patterns[0]!r}, or pass the directory {root} "
            "with --split NAME=PATTERN for each split"
        )
    return root, find_splits(root, [f"{DEFAULT_SPLIT}={pattern}"], compressed)


def find_splits(
    root: str | os.PathLike[str], patterns: Sequence[str], compressed: bool = False
) -> dict[str, list[str]]:
    """Split name -> shard paths relative to ``root``, from ``NAME=PATTERN`` arguments (brace ranges such as
    ``train-{000..099}.tar`` everywhere, ``*`` globs on a local directory), else, for a local directory, one
    split per sub-directory holding tars (ddp_rank's own layout), else all its tars as ``train``. A directory
    listed that holds compressed tars is refused (``CompressedShardError``), unless ``compressed``: then they
    are listed with the plain ones (``reshard`` decompresses them)."""
    remote = is_url(root)
    root = os.fspath(root)
    if not remote and not Path(root).is_dir():
        what = "is a file, not a directory" if Path(root).exists() else "does not exist"
        raise ShardIndexError(
            f"{root} {what}: name a directory of shards, a URL, or a brace pattern of shards"
        )
    splits: dict[str, list[str]] = {}
    for pattern in patterns:
        name, sep, expr = pattern.partition("=")
        if not sep or not name or not expr:
            raise ShardIndexError(
                f"--split {pattern!r}: write NAME=PATTERN, e.g. train='train-{{000..099}}.tar'"
            )
        if problem := split_name_problem(name):
            raise ShardIndexError(f"--split {pattern!r}: {problem}")
        splits[name] = _expand(root, pattern, expr, remote)
    if splits:
        return splits
    if remote:
        raise ShardIndexError(
            f"{root} is a URL: name each split's shards, e.g. --split train='train-{{000..099}}.tar'"
        )
    base = Path(root)
    if not compressed:
        refuse_compressed(base)

    def shards(folder: Path) -> list[str]:
        found = (p for p in folder.glob("*") if p.is_file() and _is_shard_name(p.name, compressed))
        return sorted((str(p.relative_to(base)) for p in found), key=natural_key)

    for sub in sorted(p for p in base.iterdir() if p.is_dir()):
        if tars := shards(sub):
            splits[sub.name] = tars
    if not splits:
        tars = shards(base)
        if not tars:
            kinds = ".tar (or compressed tar)" if compressed else ".tar"
            raise ShardIndexError(f"no {kinds} shard found in {base} or its sub-directories")
        splits[DEFAULT_SPLIT] = tars
    return splits


def _is_shard_name(name: str, compressed: bool) -> bool:
    return name.lower().endswith(".tar") or (compressed and compressed_suffix(name) is not None)


def _expand(root: str, pattern: str, expr: str, remote: bool) -> list[str]:
    """The shards ``expr`` names under ``root`` (relative paths, in natural order for a glob)."""
    expanded = list(braceexpand(expr))
    if remote:
        if any(ch in expr for ch in _GLOB):
            raise ShardIndexError(
                f"--split {pattern!r}: a URL cannot be listed; name the shards with a brace range"
            )
        for e in expanded:  # not listed, so not confined by ``_inside``: check each name as a manifest path
            if problem := shard_path_problem(e):
                raise ShardIndexError(
                    f"--split {pattern!r}: the shard name {e!r} {problem}; name shards under {root}"
                )
        return expanded
    base = Path(root)
    found: set[str] = set()
    for e in expanded:
        if not any(ch in e for ch in _GLOB):
            if not (base / e).is_file():
                missing = "no such file" if not (base / e).exists() else "not a file"
                raise ShardIndexError(
                    f"{base / e}: {missing}, the first missing one of the {len(expanded)} shard(s) that "
                    f"{expr!r} names; fix the pattern (or the range) to name only the shards there"
                )
            found.add(_inside(base, str(base / e), pattern))
        else:
            found.update(_inside(base, p, pattern) for p in glob.glob(str(base / e)) if Path(p).is_file())
    if not found:
        raise ShardIndexError(f"--split {pattern!r}: no file of {root} matches {expr!r}")
    return sorted(found, key=natural_key)


def _inside(base: Path, path: str, pattern: str) -> str:
    """``path`` relative to ``base``, refused when it lies outside (``..``): a manifest's shards sit under its root."""
    rel = os.path.normpath(os.path.relpath(path, base))
    if rel == ".." or rel.startswith(("../", "..\\")) or os.path.isabs(rel):
        raise ShardIndexError(f"--split {pattern!r}: {path} lies outside {base}; name shards under it")
    return rel
