"""Digests of the files a run writes, and the check of those files against them before anything parses them.

Why: a checkpoint, an export or an index is read back long after it was written, often from another machine,
and a copy cut short or a disk error turns into a parser's traceback (safetensors' ``SafetensorError``, torch's
``PytorchStreamReader``, a faiss C++ stack, numpy's ``BadZipFile``) that names neither the file nor the fix. The
writer records each file's size and SHA-256 (:func:`digest_files`); the reader compares them first
(:func:`recorded_problem`) and refuses in one line that names the file.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["FileRecord", "digest_files", "file_digest", "recorded_problem", "size_problem"]

FileRecord = dict[str, Any]
"""``{"bytes": <size>, "sha256": <hex digest>}`` of one file."""

_BLOCK = 1 << 20


def file_digest(path: str | os.PathLike[str]) -> FileRecord:
    """The size and SHA-256 of ``path`` (read in 1 MiB blocks: memory does not grow with the file)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(_BLOCK):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def digest_files(root: str | os.PathLike[str], skip: Iterable[str] = ()) -> dict[str, FileRecord]:
    """``{relative posix path: record}`` of every file under ``root`` but the names in ``skip``, sorted."""
    root = Path(root)
    skipped = set(skip)
    out: dict[str, FileRecord] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel not in skipped:
            out[rel] = file_digest(path)
    return out


def _valid_record(name: Any, record: Any) -> bool:
    return (
        isinstance(name, str)
        and bool(name)
        and not name.startswith("/")
        and ".." not in Path(name).parts
        and isinstance(record, Mapping)
        and isinstance(record.get("bytes"), int)
        and not isinstance(record.get("bytes"), bool)
        and record["bytes"] >= 0
        and isinstance(record.get("sha256"), str)
        and len(record["sha256"]) == 64
    )


def size_problem(path: Path, expected: int) -> str | None:
    """Why ``path`` is not a file of ``expected`` bytes (missing, not a file, another size), or None."""
    if not path.exists():
        return f"{path.name} is missing"
    if not path.is_file():
        return f"{path.name} is not a file"
    size = path.stat().st_size
    if size != expected:
        cut = "truncated" if size < expected else "longer than written"
        return f"{path.name} has {size} bytes where {expected} were written ({cut})"
    return None


def recorded_problem(root: Path, records: Any, where: str) -> str | None:
    """The first file under ``root`` that differs from its record (missing, another size, another digest), or
    a record that is not one (``where`` names the file holding the records); None when every file matches.

    Sizes are compared first, for every file, so a truncated file is reported without reading the others."""
    if not isinstance(records, Mapping) or not all(_valid_record(k, v) for k, v in records.items()):
        return f"{where}'s record of the files is damaged (not a mapping of names to bytes and sha256)"
    for name, record in records.items():
        problem = size_problem(root / name, int(record["bytes"]))
        if problem is not None:
            return problem.replace(Path(name).name, name, 1)
    for name, record in records.items():
        if file_digest(root / name)["sha256"] != record["sha256"]:
            return f"{name} does not match the SHA-256 recorded in {where} (its bytes changed after it was written)"
    return None
