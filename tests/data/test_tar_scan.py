"""The tar reading side: one header decoder (``decode_header``) for a class's byte range and for a whole
shard's scan, with tarfile taking over for other dialects; damage is named by byte and kind."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddp_rank.data.format import tar_scan
from ddp_rank.data.format.manifest import span_digest
from ddp_rank.data.format.tar_scan import CorruptHeader, SpanError, decode_header, parse_span, scan_shard
from ddp_rank.data.format.tar_writer import shard_writer

_SAMPLES = [(f"k{i}", bytes([i]) * (100 + 300 * i)) for i in range(3)]


def _our_shard(path: Path) -> tuple[bytes, int, int]:
    """A shard of one class of three samples written by ``ShardWriter``: (bytes, span offset, span length)."""
    with shard_writer(path) as writer:
        for key, image in _SAMPLES:
            writer.add(key, "png", image, 5, {"key": key})
        writer.close()
    (span,) = writer.spans
    return path.read_bytes(), span.offset, span.length


def _foreign_span(fmt: int) -> bytes:
    """The member bytes (no end-of-archive marker) of the same samples as tarfile writes them in ``fmt``,
    with one key over 100 bytes (a pax or GNU long-name header)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for key, image in _SAMPLES:
            key = key + "x" * 120 if key == "k1" else key
            for name, data in ((f"{key}.png", image), (f"{key}.json", b"{}")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        end = tar.offset
    return buf.getvalue()[:end]


def test_decode_header_reads_our_headers_and_the_end_marker(tmp_path: Path) -> None:
    data, _, _ = _our_shard(tmp_path / "a.tar")
    info = decode_header(data[:512], 0)
    assert info is not None and (info.name, info.size) == ("k0.png", 100)
    assert decode_header(bytes(512), 4096) is None
    with pytest.raises(CorruptHeader, match="cut short inside the header at byte 7"):
        decode_header(data[:100], 7)
    flipped = bytearray(data[:512])
    flipped[0] ^= 0xFF
    with pytest.raises(CorruptHeader, match=r"corrupt tar header at byte 0 \(bad checksum\)"):
        decode_header(bytes(flipped), 0)


def test_parse_span_reads_the_class_back(tmp_path: Path) -> None:
    data, offset, length = _our_shard(tmp_path / "a.tar")
    samples = parse_span(data[offset : offset + length], 3)
    assert [(s.key, s.image_ext, s.image) for s in samples] == [(k, "png", im) for k, im in _SAMPLES]
    assert samples[1].meta == b'{"key": "k1"}'
    assert span_digest(data[offset : offset + length]) != span_digest(data[offset : offset + length - 1])


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_parse_span_reads_other_dialects_through_tarfile(fmt: int) -> None:
    samples = parse_span(_foreign_span(fmt), 3)
    assert [s.image for s in samples] == [im for _, im in _SAMPLES]
    assert samples[1].key == "k1" + "x" * 120


def test_damaged_span_is_named(tmp_path: Path) -> None:
    data, offset, length = _our_shard(tmp_path / "a.tar")
    span = bytearray(data[offset : offset + length])
    second = 512 + 512  # the header after k0.png's header and its 100 bytes (one block)
    with pytest.raises(SpanError, match=r"1 complete sample\(s\) where the manifest lists 3"):
        parse_span(bytes(span[: second * 3]), 3)
    with pytest.raises(SpanError, match="cut short inside the header at byte 1024"):
        parse_span(bytes(span[: second + 100]), 3)
    with pytest.raises(SpanError, match=r"member k0\.png is cut short"):
        parse_span(bytes(span[:600]), 3)
    zeroed = bytes(span[:second]) + bytes(512) + bytes(span[second + 512 :])
    with pytest.raises(SpanError, match="end-of-archive marker inside the class at byte 1024"):
        parse_span(zeroed, 3)
    span[second + 3] ^= 0xFF
    with pytest.raises(SpanError, match=r"corrupt tar header at byte 1024 \(bad checksum\)"):
        parse_span(bytes(span), 3)


def test_scan_of_our_shard_and_its_damage(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    data, _, _ = _our_shard(path)
    scan = scan_shard(path, expected=3)
    assert scan.error is None and [(s.key, s.class_id) for s in scan.samples] == [(k, 5) for k, _ in _SAMPLES]
    k1 = next(s for s in scan.samples if s.key == "k1")
    assert data[k1.image_offset : k1.image_offset + k1.image_size] == _SAMPLES[1][1]

    header = k1.image_offset - 512
    damaged = bytearray(data)
    damaged[header + 3] ^= 0xFF
    path.write_bytes(bytes(damaged))
    scan = scan_shard(path, expected=3)
    assert scan.error == f"corrupt tar header at byte {header} (bad checksum)"
    assert [s.key for s in scan.samples] == ["k0"]  # what came before the damage is still indexed

    path.write_bytes(data[: k1.image_offset + 10])
    assert scan_shard(path).error == "truncated inside member k1.png"
    path.write_bytes(data[:header])
    assert scan_shard(path).error == "truncated: no end-of-archive marker after 3 member(s)"


# ----------------------------------------------------------------------------------------- the header's short path
def _header(name: str, prefix: str, size: int, kind: bytes, mode: int, mtime: int, fmt: int) -> bytes:
    """One member's header as tarfile writes it in ``fmt`` (its first block: pax and GNU long names come first
    as an extended header of another type)."""
    info = tarfile.TarInfo(f"{prefix}/{name}" if prefix else name)
    info.size, info.type, info.mode, info.mtime = size, kind, mode, mtime
    return info.tobuf(fmt, "utf-8", "surrogateescape")[: tarfile.BLOCKSIZE]


def _with_checksum(block: bytearray) -> bytes:
    """``block`` with its checksum field rewritten to match (unsigned), as a writer of damaged data would."""
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return bytes(block)


def _outcome(decode: Any, block: bytes) -> object:
    try:
        return decode(block, 0)
    except (CorruptHeader, tar_scan._NeedsTarfile) as exc:
        return type(exc)


_DAMAGED_BYTE = st.one_of(st.integers(0, 511), st.integers(100, 156), st.integers(329, 345))
"""Anywhere, and often in the numeric fields and the type, where the short path must defer to tarfile."""
_DAMAGE = st.one_of(st.integers(0, 255), st.sampled_from([*b"0789 \0\t+-_/5", 0x80, 0xFF]))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.text(st.characters(codec="utf-8", exclude_characters="\0"), min_size=1, max_size=40),
    prefix=st.sampled_from(["", "a", "dir/sub", "p" * 120]),  # a name over 100 bytes: ustar's prefix field
    slash=st.booleans(),  # a v7 directory: a file whose name ends in a slash
    size=st.one_of(st.integers(0, 4096), st.integers(8**11 - 2, 8**12 + 5)),
    kind=st.sampled_from([tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, b"x"]),
    mode=st.integers(0, 0o7777),
    mtime=st.integers(0, 2**33),
    fmt=st.sampled_from([tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]),
    damage=st.lists(st.tuples(_DAMAGED_BYTE, _DAMAGE), max_size=4),
    fix_checksum=st.booleans(),
)
def test_the_short_path_answers_as_tarfile_does(
    name: str, prefix: str, slash: bool, size: int, kind: bytes, mode: int, mtime: int, fmt: int,
    damage: list[tuple[int, int]], fix_checksum: bool,
) -> None:  # fmt: skip
    """Whatever the header (names of any script, big sizes in base-256, other member types, bytes changed with or
    without a checksum that matches), ``decode_header`` gives what ``frombuf`` gives: the same name, size and
    type, or the same refusal."""
    try:
        block = bytearray(_header(name + "/" * slash, prefix, size, kind, mode, mtime, fmt))
    except (ValueError, UnicodeError):
        return  # a header tarfile cannot write in this format
    for pos, value in damage:
        block[pos] = value
    data = _with_checksum(block) if fix_checksum else bytes(block)
    if data == bytes(tarfile.BLOCKSIZE):
        return
    assert _outcome(decode_header, data) == _outcome(tar_scan._decode_with_tarfile, data)


def test_the_short_path_takes_the_common_header_and_leaves_the_rest_to_tarfile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast path is taken for our own headers (else it would save nothing), and tarfile decides a header
    in another form: a base-256 size, a signed checksum, a tab in a numeric field."""
    calls: list[bytes] = []
    slow = tar_scan._decode_with_tarfile
    monkeypatch.setattr(
        tar_scan, "_decode_with_tarfile", lambda block, pos: calls.append(block) or slow(block, pos)
    )
    ours = _header("s000001.f16", "", 3584, tarfile.REGTYPE, 0o644, 1_700_000_000, tarfile.USTAR_FORMAT)
    assert decode_header(ours, 0) == tar_scan.Header("s000001.f16", 3584, tarfile.REGTYPE)
    assert calls == []
    big = _header("big.bin", "", 8**11 + 1, tarfile.REGTYPE, 0o644, 0, tarfile.GNU_FORMAT)  # base-256 size
    assert decode_header(big, 0) == tar_scan.Header("big.bin", 8**11 + 1, tarfile.REGTYPE)
    tabbed = bytearray(ours)
    tabbed[100:108] = b"\t000644\0"
    assert decode_header(_with_checksum(tabbed), 0) == tar_scan.Header("s000001.f16", 3584, tarfile.REGTYPE)
    high = bytearray(ours)
    high[300] = 0xE9  # a byte with the high bit set in the group name: the signed checksum differs
    high[148:156] = b" " * 8
    signed = sum(b - 256 if b > 127 else b for b in high)
    high[148:156] = b"%06o\0 " % signed
    assert decode_header(bytes(high), 0) == tar_scan.Header("s000001.f16", 3584, tarfile.REGTYPE)
    assert len(calls) == 3
