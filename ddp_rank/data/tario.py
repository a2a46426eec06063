"""Reading and writing the tar shards, byte-exact and without trusting their contents.

Writing: members get fixed metadata (mtime 0, uid/gid 0, mode 0644) so the same input gives the same bytes, and
a shard only appears under its final name once complete (temporary name, then ``os.replace``). The writer records
each class's byte range and its digest as it goes (classes are written contiguously), for the manifest.

Reading a class: ``parse_span`` turns the bytes of one class's range back into samples (any tar dialect).

Checking: ``scan_shard`` walks the tar headers once (seeking over the data) and records where each sample's image
and ``.cls`` members live; ``ddp-rank shards verify`` uses it to prove a whole shard is sound. A corrupt header or a
truncated file ends the scan with a reason instead of an exception, and samples missing a required member are
dropped, so one bad shard costs its own samples and nothing else. Shards made by other tools and indexed
(``labelled=False``) need only an image per sample: their classes come from the manifest. Only image, ``.cls``
and ``.json`` bytes are ever interpreted: there is no pickle decoder anywhere in the read path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, NamedTuple

from ddp_rank.data.manifest import IMAGE_EXTENSIONS, ClassSpan

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)


def span_digest(data: bytes | memoryview) -> str:
    """The digest of a class's byte range that the manifest stores (``manifest.SPAN_DIGEST``)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
            self._hasher.span = hashlib.blake2b(digest_size=16)
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


@dataclass(frozen=True)
class SampleEntry:
    """Where one complete sample lives inside its shard. ``class_id`` and the json extent are None for a
    sample of an indexed shard (``scan_shard(labelled=False)``), whose class the manifest holds."""

    key: str
    class_id: int | None
    image_ext: str
    image_offset: int
    image_size: int
    json_offset: int | None
    json_size: int | None


@dataclass
class ShardScan:
    """Result of scanning one shard: the usable samples in stored order, and what was wrong if anything."""

    path: Path
    samples: list[SampleEntry] = field(default_factory=list)
    error: str | None = None
    dropped: int = 0


def _read_at(f: IO[bytes], offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise EOFError(f"expected {size} bytes at offset {offset}, got {len(data)}")
    return data


class Member(NamedTuple):
    """A regular file inside a tar: its name, where its data lies, and the data itself for ``.cls`` members
    (read along with the header, to save a seek per sample)."""

    name: str
    offset_data: int
    size: int
    data: bytes | None = None


class _NotPlainUstar(Exception):
    """The fast header walk met something only tarfile handles (pax/GNU headers, base-256 sizes)."""


def _ustar_members(f: IO[bytes], file_size: int) -> tuple[list[Member], str | None]:
    """Walk the 512-byte headers with a seek each (about 10x faster than tarfile, which matters: every worker
    indexes its share at the start of every epoch). Checks each header's checksum; a missing end-of-archive
    marker means the file was cut."""
    members: list[Member] = []
    pos = 0
    while True:
        f.seek(pos)
        block = f.read(_BLOCK)
        if len(block) < _BLOCK:
            return members, f"truncated: no end-of-archive marker after {len(members)} member(s)"
        if block == _ZERO_BLOCK:
            return members, None
        try:
            stored = int(block[148:156].strip(b"\0 ") or b"0", 8)
        except ValueError:
            return members, f"corrupt header at byte {pos}"
        if stored != sum(block) - sum(block[148:156]) + 8 * 32:
            return members, f"corrupt header at byte {pos} (checksum mismatch)"
        kind = block[156:157]
        if kind not in (b"0", b"\0", b"5") or block[124] & 0x80:
            raise _NotPlainUstar
        size = int(block[124:136].strip(b"\0 ") or b"0", 8)
        name = block[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        prefix = block[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
        if block[257:262] == b"ustar" and prefix:
            name = f"{prefix}/{name}"
        if kind != b"5":
            data = f.read(size) if name.endswith(".cls") and size <= _BLOCK else None
            members.append(Member(name, pos + _BLOCK, size, data))
        pos += _BLOCK + -(-size // _BLOCK) * _BLOCK
        if pos > file_size:
            return members, f"truncated inside member {name}"


def _tarfile_members(f: IO[bytes]) -> tuple[list[Member], str | None]:
    """The general walk (any tar dialect), for shards written by other tools."""
    f.seek(0)
    members: list[Member] = []
    with tarfile.open(fileobj=f, mode="r:") as tar:
        while True:
            try:
                info = tar.next()
            except (tarfile.TarError, OSError, EOFError) as exc:
                return members, f"corrupt tar after {len(members)} member(s): {exc}"
            if info is None:
                return members, end_of_archive_problem(f, tar.offset)
            if info.isfile():
                members.append(Member(info.name, info.offset_data, info.size))


def end_of_archive_problem(f: IO[bytes], offset: int) -> str | None:
    """Why a tarfile walk that stopped at ``offset`` did not reach the end of the archive, or None: it stopped at
    the end-of-archive marker (zero bytes). tarfile stops quietly at a corrupt header after the first, or where a
    file was cut between members, so a walk that trusts it reads only part of the shard."""
    f.seek(offset)
    block = f.read(_BLOCK)
    if not block:
        return f"no end-of-archive marker after byte {offset}: the file was cut short"
    if block.count(0) == len(block):
        return None
    if len(block) < _BLOCK:
        return f"the file was cut short inside the header at byte {offset}"
    size = os.fstat(f.fileno()).st_size
    return f"corrupt tar header at byte {offset} of {size}; the rest of the shard cannot be read"


def scan_shard(path: str | os.PathLike[str], expected: int | None = None, labelled: bool = True) -> ShardScan:
    """Index a shard's samples by walking headers; never raises for a bad shard (see ``ShardScan.error``).

    ``expected`` (the manifest's count) also catches samples lost in ways the walk cannot see. ``labelled``:
    a sample needs its ``.cls`` (the class id) and ``.json`` members, as ddp_rank writes them; False for shards
    made by other tools and indexed, where a sample needs only an image (the manifest knows its class, and the
    index left out samples without an image, so they are skipped here too).
    """
    scan = ShardScan(path=Path(path))
    try:
        file_size = os.path.getsize(path)
        # A 64 KiB buffer turns the seeks between small members into memory moves.
        with open(path, "rb", buffering=1 << 16) as f:
            try:
                members, scan.error = _ustar_members(f, file_size)
            except _NotPlainUstar:
                members, scan.error = _tarfile_members(f)
            groups: dict[str, dict[str, Member]] = {}
            for m in members:
                key, ext = sample_key(m.name)
                groups.setdefault(key, {})[ext] = m
            for key, parts in groups.items():
                if not labelled and not any(e in parts for e in IMAGE_EXTENSIONS):
                    continue
                entry = _complete_sample(f, key, parts, file_size, labelled)
                if entry is None:
                    scan.dropped += 1
                else:
                    scan.samples.append(entry)
    except (tarfile.TarError, OSError, EOFError) as exc:
        scan.error = f"unreadable shard: {exc}"
    if scan.dropped and scan.error is None:
        missing = "image/.cls/.json" if labelled else "image"
        scan.error = f"{scan.dropped} incomplete sample(s) (missing {missing} or truncated data)"
    if expected is not None and len(scan.samples) < expected and scan.error is None:
        scan.error = f"only {len(scan.samples)} of {expected} samples"
    return scan


def _complete_sample(
    f: IO[bytes], key: str, members: dict[str, Member], file_size: int, labelled: bool = True
) -> SampleEntry | None:
    """The sample, or None when a required member is missing or cut short (``scan_shard``'s ``labelled``)."""
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in members), None)
    if image_ext is None:
        return None
    if any(m.offset_data + m.size > file_size for m in members.values()):
        return None
    image, meta = members[image_ext], members.get("json")
    class_id = None
    if labelled:
        if "cls" not in members or meta is None:
            return None
        cls = members["cls"]
        try:
            raw = cls.data if cls.data is not None else _read_at(f, cls.offset_data, cls.size)
            class_id = int(raw.decode("ascii").strip())
        except (ValueError, UnicodeDecodeError, EOFError):
            return None
    return SampleEntry(
        key=key,
        class_id=class_id,
        image_ext=image_ext,
        image_offset=image.offset_data,
        image_size=image.size,
        json_offset=None if meta is None else meta.offset_data,
        json_size=None if meta is None else meta.size,
    )


def sample_key(member: str) -> tuple[str, str]:
    """(sample key, lower-case extension) of a member name, as WebDataset splits them: the key is the path up to
    the first dot of the file name (``dir/abc.seg.png`` -> ``dir/abc``, ``seg.png``)."""
    directory, base = os.path.split(member)
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext.lower()


def _ustar_span(data: bytes) -> list[tuple[str, bytes]]:
    """(name, data) of the regular members in a class's range, walking plain ustar headers in memory."""
    members: list[tuple[str, bytes]] = []
    view = memoryview(data)
    pos = 0
    while pos < len(data):
        block = data[pos : pos + _BLOCK]
        if len(block) < _BLOCK:
            raise SpanError(f"cut short inside a header at byte {pos}")
        if block == _ZERO_BLOCK:
            raise SpanError(f"end-of-archive marker inside the class at byte {pos}")
        try:
            stored = int(block[148:156].strip(b"\0 ") or b"0", 8)
            size = int(block[124:136].strip(b"\0 ") or b"0", 8)
        except ValueError as exc:
            raise _NotPlainUstar from exc
        if stored != sum(block) - sum(block[148:156]) + 8 * 32:
            raise SpanError(f"corrupt header at byte {pos} (checksum mismatch)")
        kind = block[156:157]
        if kind not in (b"0", b"\0", b"5") or block[124] & 0x80:
            raise _NotPlainUstar
        name = block[0:100].split(b"\0", 1)[0].decode("utf-8", "replace")
        prefix = block[345:500].split(b"\0", 1)[0].decode("utf-8", "replace")
        if block[257:262] == b"ustar" and prefix:
            name = f"{prefix}/{name}"
        start = pos + _BLOCK
        if start + size > len(data):
            raise SpanError(f"member {name} is cut short")
        if kind != b"5":
            members.append((name, bytes(view[start : start + size])))
        pos = start + -(-size // _BLOCK) * _BLOCK
    return members


def _tarfile_span(data: bytes) -> list[tuple[str, bytes]]:
    members: list[tuple[str, bytes]] = []
    try:
        with tarfile.open(fileobj=io.BytesIO(data + _ZERO_BLOCK * 2), mode="r:") as tar:
            for info in tar:
                if info.isfile():
                    extracted = tar.extractfile(info)
                    payload = extracted.read() if extracted is not None else b""
                    if len(payload) != info.size:
                        raise SpanError(f"member {info.name} is cut short")
                    members.append((info.name, payload))
    except (tarfile.TarError, EOFError) as exc:
        raise SpanError(f"corrupt tar data: {exc}") from exc
    return members


@dataclass(frozen=True)
class SpanSample:
    """One sample read from a class's byte range: its key and member bytes (json may be absent in foreign
    shards; the class is known from the manifest, not from the members)."""

    key: str
    image_ext: str
    image: bytes
    meta: bytes | None


class SpanError(ValueError):
    """A class's byte range is not what the manifest says (truncated, corrupt, wrong sample count)."""


def parse_span(data: bytes, expected: int) -> list[SpanSample]:
    """The samples of one class from the bytes of its range, in stored order; raises ``SpanError`` unless all
    ``expected`` samples are complete. Plain ustar headers (ours, and most writers') are walked in memory;
    anything else (pax or GNU headers) goes through tarfile, so every dialect reads alike. Only image and json
    bytes are kept; nothing is decoded here."""
    try:
        members = _ustar_span(data)
    except _NotPlainUstar:
        members = _tarfile_span(data)
    groups: dict[str, dict[str, bytes]] = {}
    for name, payload in members:
        key, ext = sample_key(name)
        parts = groups.setdefault(key, {})
        if ext in IMAGE_EXTENSIONS or ext == "json":
            parts[ext] = payload
    samples = []
    for key, parts in groups.items():
        image_ext = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
        if image_ext is not None:
            samples.append(SpanSample(key, image_ext, parts[image_ext], parts.get("json")))
    if len(samples) != expected:
        raise SpanError(f"{len(samples)} complete sample(s) where the manifest lists {expected}")
    return samples
