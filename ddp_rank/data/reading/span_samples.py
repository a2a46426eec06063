"""The samples of one span of a source shard, checked against the manifest: from bytes read whole, or streamed.

``checked_samples`` takes the bytes of a span as ``ShardStore.read_many`` gave them (or the exception it gave) and
returns the span's samples once its digest and sample count match the manifest. ``streamed_samples`` reads a span
too large to hold member by member (one image in memory at a time, the storage read in blocks), yielding samples
as they come and checking the digest and count at the span's end: a consumer that writes them out must be able to
drop what it wrote when that check fails (``reshard`` writes into a shard that is then never renamed into place).
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from typing import Any, BinaryIO

from ddp_rank.data.format.manifest import IMAGE_EXTENSIONS, ClassSpan, ShardInfo, span_digest, span_hasher
from ddp_rank.data.format.tar_scan import SpanError, SpanSample, parse_span, sample_key
from ddp_rank.data.reading.storage import ShardStore

FIX = "check the source with `ddp-rank shards verify`, re-index it, then rerun the reshard"


class SpanReadError(ValueError):
    """A source span is not what the manifest says, or could not be read; the message names the shard and class."""


class _HashedWindow(io.RawIOBase):
    """``length`` bytes of ``f`` from its current position, hashed as they are read (a span's digest)."""

    def __init__(self, f: BinaryIO, length: int) -> None:
        self.f, self.left, self.hasher = f, length, span_hasher()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self.f.read(min(len(buffer), self.left))
        self.left -= len(data)
        self.hasher.update(data)
        buffer[: len(data)] = data
        return len(data)


def streamed_samples(
    store: ShardStore, shard: ShardInfo, span: ClassSpan, memory_bytes: int
) -> Iterator[SpanSample]:
    """The samples of a span larger than ``memory_bytes``, read member by member (one image in memory at a
    time, the storage read in blocks of at most ``memory_bytes``); the digest and count are checked at the end
    (a mismatch raises, and the output shard in progress is dropped)."""
    where = f"{shard.path}: class {span.id} at byte {span.offset}"
    count = 0
    try:
        with store.open_file(shard, block_size=max(1 << 16, min(memory_bytes, 1 << 22))) as f:
            f.seek(span.offset)
            window = _HashedWindow(f, span.length)
            with tarfile.open(fileobj=io.BufferedReader(window, 1 << 16), mode="r|") as tar:
                key: str | None = None
                parts: dict[str, bytes] = {}
                for info in tar:
                    name_key, ext = sample_key(info.name)
                    if name_key != key:
                        sample = _sample(key, parts)
                        if sample is not None:
                            count += 1
                            yield sample
                        key, parts = name_key, {}
                    if info.isfile() and (ext in IMAGE_EXTENSIONS or ext == "json"):
                        member = tar.extractfile(info)
                        parts[ext] = member.read() if member is not None else b""
                sample = _sample(key, parts)
                if sample is not None:
                    count += 1
                    yield sample
            while window.read(
                1 << 16
            ):  # the rest of the span (padding tarfile leaves unread), for the digest
                pass
    except SpanReadError:
        raise
    except Exception as exc:  # a corrupt tar, a short file, or whatever the storage raised (an HTTP error)
        raise SpanReadError(f"{where}: {type(exc).__name__}: {exc}; {FIX}") from exc
    if window.left or window.hasher.hexdigest() != span.digest:
        raise SpanReadError(f"{where}: bytes do not match the manifest's digest; {FIX}")
    if count != span.count:
        raise SpanReadError(
            f"{where}: {count} complete sample(s) where the manifest lists {span.count}; {FIX}"
        )


def _sample(key: str | None, parts: dict[str, bytes]) -> SpanSample | None:
    image_ext = next((e for e in IMAGE_EXTENSIONS if e in parts), None)
    if key is None or image_ext is None:
        return None
    return SpanSample(key, image_ext, parts[image_ext], parts.get("json"))


def checked_samples(shard: ShardInfo, span: ClassSpan, data: bytes | Exception) -> list[SpanSample]:
    if isinstance(data, Exception):
        raise SpanReadError(f"{shard.path}: class {span.id}: {type(data).__name__}: {data}; {FIX}")
    if span_digest(data) != span.digest:
        raise SpanReadError(
            f"{shard.path}: class {span.id} at byte {span.offset}: bytes do not match the manifest's digest; {FIX}"
        )
    try:
        return parse_span(data, span.count)
    except SpanError as exc:
        raise SpanReadError(f"{shard.path}: class {span.id} at byte {span.offset}: {exc}; {FIX}") from exc
