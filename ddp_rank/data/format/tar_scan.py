"""Reading tar shards without trusting their contents: one class's byte range, or a whole shard's index.

Reading a class: ``parse_span`` turns the bytes of one class's range back into samples (any tar dialect).

Checking: ``scan_shard`` names a compressed tar as such (``compressed``: by its magic bytes), else walks the tar
headers once (seeking over the data) and records where each sample's image and ``.cls`` members live;
``ddp-rank shards verify`` uses it to prove a whole shard is sound. A corrupt header or a
truncated file ends the scan with a reason instead of an exception, and samples missing a required member are
dropped, so one bad shard costs its own samples and nothing else. Shards made by other tools and indexed
(``labelled=False``) need only an image per sample: their classes come from the manifest. Only image, ``.cls``
and ``.json`` bytes are ever interpreted (and the raw float16 ``.f16`` vector of a feature sample, which takes
an image's place: ``data.features.records``): there is no pickle decoder anywhere in the read path.

Both walk the 512-byte headers with one decoder, ``decode_header``, seeking over member data. It accepts what
stdlib ``tarfile.TarInfo.frombuf`` accepts, with the same name, size and type: the common header (a file or a
directory, every numeric field plain octal, the unsigned checksum) is read by a short path of its own, three
times faster than ``frombuf``, and every other header goes through ``frombuf`` (base-256 sizes, signed
checksums, odd spacing, and the faults it names). The speed matters for feature shards, whose samples are a few
KB each: there a class's headers cost more than its data, and every training step reads a hundred classes or
more. Unlike a tarfile walk, which stops quietly at a corrupt header or a file cut between members, this walk
names the byte and the fault. A header only tarfile can resolve (pax or GNU extended headers: long names, big
sizes; links) sends the whole walk through tarfile instead, so every dialect reads alike.
"""

from __future__ import annotations

import io
import os
import re
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple

from ddp_rank.data.format.compressed import CompressedShardError, sniff
from ddp_rank.data.format.manifest import PAYLOAD_EXTENSIONS

_BLOCK = tarfile.BLOCKSIZE
_ZERO_BLOCK = bytes(_BLOCK)
_PLAIN_TYPES = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE)
"""Member types the header walk handles itself: files and directories of plain ustar / v7 tars (ours, and most
writers')."""


class CorruptHeader(ValueError):
    """A tar header that cannot be read; the message says at which byte and why."""


class _NeedsTarfile(Exception):
    """A header only tarfile's full walk resolves (pax / GNU extended headers, links)."""


class Header(NamedTuple):
    """What the walks need of a member's header: its full name (ustar prefix joined), data size and type."""

    name: str
    size: int
    type: bytes

    def isdir(self) -> bool:
        return self.type == tarfile.DIRTYPE


_OCTAL_FIELD = re.compile(rb" *[0-7]* *(?:\0[\s\S]*)?")
"""A numeric field in its common form: spaces, octal digits, spaces, then a NUL and anything. tarfile reads more
forms (base-256, other whitespace, a sign); those go through it."""
_NUMERIC_FIELDS = (
    (100, 108),
    (108, 116),
    (116, 124),
    (124, 136),
    (136, 148),
    (148, 156),
    (329, 337),
    (337, 345),
)
"""mode, uid, gid, size, mtime, checksum, devmajor, devminor: the fields ``frombuf`` reads as numbers."""


def decode_header(block: bytes, pos: int) -> Header | None:
    """The member whose 512-byte header is ``block`` (read at byte ``pos``), or None for the end-of-archive
    marker (a zero block). Raises ``CorruptHeader`` for a short block, a checksum mismatch or an unreadable
    field, and ``_NeedsTarfile`` for a member type of another dialect. The same answers as
    ``_decode_with_tarfile``, faster for the common header (see the module's docstring)."""
    if len(block) < _BLOCK:
        raise CorruptHeader(f"cut short inside the header at byte {pos}")
    if block == _ZERO_BLOCK:
        return None
    kind = block[156:157]
    common = kind in _PLAIN_TYPES and all(_OCTAL_FIELD.fullmatch(block, a, b) for a, b in _NUMERIC_FIELDS)
    # The unsigned checksum: every byte, the checksum field's own counted as 8 spaces.
    if not common or _octal(block, 148, 156) != sum(block) - sum(block[148:156]) + 8 * ord(" "):
        return _decode_with_tarfile(block, pos)
    name = _text(block, 0, 100)
    if kind == tarfile.AREGTYPE and name.endswith("/"):  # a v7 directory
        kind = tarfile.DIRTYPE
    if kind == tarfile.DIRTYPE:
        name = name.rstrip("/")
    prefix = _text(block, 345, 500)
    return Header(f"{prefix}/{name}" if prefix else name, _octal(block, 124, 136), kind)


def _decode_with_tarfile(block: bytes, pos: int) -> Header:
    """``decode_header`` by stdlib ``tarfile.TarInfo.frombuf`` (which checks the checksum, signed too, and reads
    every numeric field, base-256 included), for a block that is neither short nor zero."""
    # (frombuf raises subclasses of HeaderError for these, but typeshed does not name them)
    try:
        info = tarfile.TarInfo.frombuf(block, "utf-8", "replace")
    except tarfile.HeaderError as exc:  # "bad checksum", "invalid header" (a field that is not a number)
        raise CorruptHeader(f"corrupt tar header at byte {pos} ({exc})") from exc
    if info.type not in _PLAIN_TYPES:
        raise _NeedsTarfile
    return Header(info.name, info.size, info.type)


def _octal(block: bytes, start: int, end: int) -> int:
    return int(block[start:end].split(b"\0", 1)[0].strip() or b"0", 8)


def _text(block: bytes, start: int, end: int) -> str:
    return block[start:end].split(b"\0", 1)[0].decode("utf-8", "replace")


def _walk(read_header: Callable[[int], bytes], end: int) -> Iterator[tuple[int, Header | None]]:
    """``(header position, member)`` of each header from byte 0 while one starts before ``end``, seeking over
    member data; the member is None at the end-of-archive marker, which ends the walk. Raises as
    ``decode_header``."""
    pos = 0
    while pos < end:
        info = decode_header(read_header(pos), pos)
        yield pos, info
        if info is None:
            return
        pos += _BLOCK + -(-info.size // _BLOCK) * _BLOCK


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


def _plain_members(f: IO[bytes], file_size: int) -> tuple[list[Member], str | None]:
    """The members of a plain tar file (``_walk``), and why the walk stopped early if it did: a corrupt header,
    a member cut short, or no end-of-archive marker (the file was cut between members)."""
    members: list[Member] = []

    def read_header(pos: int) -> bytes:
        f.seek(pos)
        return f.read(_BLOCK)

    try:
        for pos, info in _walk(read_header, file_size):
            if info is None:
                return members, None
            if info.isdir():
                continue
            if pos + _BLOCK + info.size > file_size:
                return members, f"truncated inside member {info.name}"
            # A .cls member's bytes are read along with its header, saving a seek per sample.
            data = f.read(info.size) if info.name.endswith(".cls") and info.size <= _BLOCK else None
            members.append(Member(info.name, pos + _BLOCK, info.size, data))
    except CorruptHeader as exc:
        return members, str(exc)
    return members, f"truncated: no end-of-archive marker after {len(members)} member(s)"


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


def tar_members(f: IO[bytes]) -> tuple[list[Member], str | None]:
    """The regular members of the plain tar open as ``f`` (a local file), in stored order, and why the walk
    stopped before the end-of-archive marker (a corrupt header, a member or the file cut short), else None.
    The header walk of ``scan_shard``: tarfile's for the headers only it resolves."""
    try:
        return _plain_members(f, os.fstat(f.fileno()).st_size)
    except _NeedsTarfile:
        try:
            return _tarfile_members(f)
        except (tarfile.TarError, EOFError) as exc:
            return [], f"unreadable tar: {exc}"


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
            compression = sniff(f)
            if compression is not None:
                scan.error = str(
                    CompressedShardError(
                        f"a {compression}-compressed tar where a plain one belongs (replaced since it was "
                        "indexed?): compressed shards cannot be read by byte range",
                        compression,
                    )
                )
                return scan
            try:
                members, scan.error = _plain_members(f, file_size)
            except _NeedsTarfile:
                members, scan.error = _tarfile_members(f)
            groups: dict[str, dict[str, Member]] = {}
            for m in members:
                key, ext = sample_key(m.name)
                groups.setdefault(key, {})[ext] = m
            for key, parts in groups.items():
                if not labelled and not any(e in parts for e in PAYLOAD_EXTENSIONS):
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
    image_ext = next((e for e in PAYLOAD_EXTENSIONS if e in members), None)
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


def _plain_span(data: bytes) -> list[tuple[str, bytes]]:
    """(name, data) of the regular members in a class's range of a plain tar (``_walk``, in memory)."""
    members: list[tuple[str, bytes]] = []
    view = memoryview(data)
    try:
        for pos, info in _walk(lambda pos: data[pos : pos + _BLOCK], len(data)):
            if info is None:
                raise SpanError(f"end-of-archive marker inside the class at byte {pos}")
            start = pos + _BLOCK
            if start + info.size > len(data):
                raise SpanError(f"member {info.name} is cut short")
            if not info.isdir():
                members.append((info.name, bytes(view[start : start + info.size])))
    except CorruptHeader as exc:
        raise SpanError(str(exc)) from exc
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
        members = _plain_span(data)
    except _NeedsTarfile:
        members = _tarfile_span(data)
    groups: dict[str, dict[str, bytes]] = {}
    for name, payload in members:
        key, ext = sample_key(name)
        parts = groups.setdefault(key, {})
        if ext in PAYLOAD_EXTENSIONS or ext == "json":
            parts[ext] = payload
    samples = []
    for key, parts in groups.items():
        image_ext = next((e for e in PAYLOAD_EXTENSIONS if e in parts), None)
        if image_ext is not None:
            samples.append(SpanSample(key, image_ext, parts[image_ext], parts.get("json")))
    if len(samples) != expected:
        raise SpanError(f"{len(samples)} complete sample(s) where the manifest lists {expected}")
    return samples
