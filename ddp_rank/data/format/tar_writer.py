"""Writing tar shards, byte-exact and all-or-nothing.

Members get fixed metadata (mtime 0, uid/gid 0, mode 0644) so the same input gives the same bytes, and a shard
only appears under its final name once complete (temporary name, then ``os.replace``). The writer records each
class's byte range and its digest as it goes (classes are written contiguously), for the manifest. Reading them
back is ``tar_scan``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from ddp_rank.data.format.manifest import ClassSpan, span_hasher


class _HashingWriter:
    """File wrapper that hashes and counts what tarfile writes, so the checksums cost no second read: the
    whole shard's sha256 and, while a class is open, that class's span digest."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()
        self.span: Any = None
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        if self.span is not None:
            self.span.update(data)
        self.size += len(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.size


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


class ShardWriter:
    """Writes one shard to ``<dir>/.<name>.partial`` and renames it to ``<name>`` only in ``close()``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.partial = path.with_name(f".{path.name}.partial")
        self._file = self.partial.open("wb")
        self._hasher = _HashingWriter(self._file)
        # tarfile only calls write() and tell() on the file object it is given.
        self._tar = tarfile.TarFile(fileobj=self._hasher, mode="w", format=tarfile.USTAR_FORMAT)  # type: ignore[arg-type]
        self.samples = 0
        self.spans: list[ClassSpan] = []
        self._open: tuple[int, int, int] | None = (
            None  # (class id, samples, offset) of the class being written
        )

    def add(self, key: str, image_ext: str, image: bytes, class_id: int, meta: dict[str, Any]) -> None:
        """Append one sample; samples of a class must be added consecutively (a class is one byte range)."""
        if self._open is None or self._open[0] != class_id:
            self._close_span()
            if any(s.id == class_id for s in self.spans):
                raise ValueError(f"class {class_id} is split in {self.path}: add a class's samples together")
            self._open = (class_id, 0, self._hasher.size)
            self._hasher.span = span_hasher()
        meta_bytes = json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")
        for name, data in (
            (f"{key}.{image_ext}", image),
            (f"{key}.cls", str(class_id).encode("ascii")),
            (f"{key}.json", meta_bytes),
        ):
            self._tar.addfile(_member(name, len(data)), io.BytesIO(data))
        self.samples += 1
        class_id, count, offset = self._open
        self._open = (class_id, count + 1, offset)

    def _close_span(self) -> None:
        if self._open is not None:
            class_id, count, offset = self._open
            digest = self._hasher.span.hexdigest()
            self.spans.append(ClassSpan(class_id, count, offset, self._hasher.size - offset, digest))
            self._open, self._hasher.span = None, None

    def close(self) -> tuple[int, str]:
        """Finish the tar, rename it into place; returns (bytes, sha256). ``spans`` then lists the classes."""
        self._close_span()
        self._tar.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.partial, self.path)
        return self._hasher.size, self._hasher.digest.hexdigest()

    def abort(self) -> None:
        """Drop the partial file (called on any error, so nothing half-written survives under any name)."""
        self._file.close()
        self.partial.unlink(missing_ok=True)


@contextmanager
def shard_writer(path: Path) -> Iterator[ShardWriter]:
    writer = ShardWriter(path)
    try:
        yield writer
    except BaseException:
        writer.abort()
        raise
