"""Image bytes as users bring them and as they break: legitimate images of every kind the decoder meets (CMYK
and progressive JPEG, 16-bit, palette, one-bit and animated PNG, lossy, lossless and animated WebP, a GIF),
each cut short, flipped at random bytes and given a huge size in its header, plus decompression bombs, files
that are no image and a format the decoder refuses (EPS, which PIL would hand to Ghostscript).

``must_fail`` marks the cases every decoding path has to refuse (a bomb, a size over the default limit, a file
cut inside its header, no image at all); the others (a flipped byte, a cut in the pixel data) may decode or
not, but must end in one of the two, quickly."""

from __future__ import annotations

import io
import random
import struct
import zlib
from dataclasses import dataclass

import numpy as np
from PIL import Image

SIDE = 24


@dataclass(frozen=True)
class FuzzCase:
    name: str
    ext: str
    """The extension it is stored under (``jpg``, ``png``, ``webp``), as a shard member or a file."""
    data: bytes
    must_fail: bool


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int) -> bytes:
    """A one-bit grey PNG of ``width`` x ``height`` black pixels: 20,000 x 20,000 is 48 KB on disk, 400 million
    pixels once decoded (PIL stores a one-bit pixel in a byte)."""
    row = b"\0" + bytes((width + 7) // 8)
    compressor = zlib.compressobj(9)
    rows_per_block = max(1, 4_000_000 // len(row))
    parts = []
    for start in range(0, height, rows_per_block):
        parts.append(compressor.compress(row * min(rows_per_block, height - start)))
    parts.append(compressor.flush())
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", b"".join(parts))
        + _png_chunk(b"IEND", b"")
    )


def _encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _frames(rng: np.random.Generator, n: int) -> list[Image.Image]:
    return [Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)) for _ in range(n)]


def legitimate_images(seed: int = 0) -> list[FuzzCase]:
    """One small image of each kind; every one of them decodes."""
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (SIDE, SIDE, 4), dtype=np.uint8))
    grey16 = Image.fromarray(rng.integers(0, 65536, (SIDE, SIDE), dtype=np.uint16))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    frames = _frames(rng, 3)
    cases = [
        ("jpeg-rgb", "jpg", _encode(rgb, "JPEG")),
        ("jpeg-cmyk", "jpg", _encode(rgb.convert("CMYK"), "JPEG")),
        ("jpeg-grey", "jpg", _encode(rgb.convert("L"), "JPEG")),
        ("jpeg-progressive", "jpg", _encode(rgb, "JPEG", progressive=True)),
        ("png-rgb", "png", _encode(rgb, "PNG")),
        ("png-rgba", "png", _encode(rgba, "PNG")),
        ("png-16-bit-grey", "png", _encode(grey16, "PNG")),
        ("png-palette", "png", _encode(palette, "PNG", transparency=0)),
        ("png-one-bit", "png", _encode(rgb.convert("1"), "PNG")),
        ("png-animated", "png", _encode(frames[0], "PNG", save_all=True, append_images=frames[1:])),
        ("webp-lossy", "webp", _encode(rgb, "WEBP", quality=80)),
        ("webp-lossless", "webp", _encode(rgba, "WEBP", lossless=True)),
        ("webp-animated", "webp", _encode(frames[0], "WEBP", save_all=True, append_images=frames[1:])),
        ("gif-animated", "png", _encode(frames[0], "GIF", save_all=True, append_images=frames[1:])),
    ]
    return [FuzzCase(name, ext, data, must_fail=False) for name, ext, data in cases]


def _jpeg_huge(data: bytes) -> bytes:
    """The JPEG with 65,000 x 65,000 in its frame header (SOFn)."""
    out = bytearray(data)
    pos = 2
    while pos + 4 <= len(out):
        marker, length = out[pos + 1], struct.unpack(">H", out[pos + 2 : pos + 4])[0]
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            out[pos + 5 : pos + 9] = struct.pack(">HH", 65000, 65000)
            return bytes(out)
        pos += 2 + length
    raise ValueError("no frame header")


def forge_png_size(data: bytes) -> bytes:
    """The PNG with 30,000 x 30,000 in IHDR, its CRC made right again (a forged header, not a damaged one)."""
    ihdr = bytearray(data[12:29])
    ihdr[4:12] = struct.pack(">II", 30000, 30000)
    return data[:12] + bytes(ihdr) + struct.pack(">I", zlib.crc32(bytes(ihdr))) + data[33:]


def _webp_huge(data: bytes) -> bytes:
    """The WebP with its largest size in the header: 16,383 x 16,383 (VP8, VP8L) or 20,000 x 20,000 (VP8X)."""
    out = bytearray(data)
    kind = bytes(out[12:16])
    if kind == b"VP8X":
        out[24:30] = (19999).to_bytes(3, "little") * 2
    elif kind == b"VP8 ":
        out[26:30] = struct.pack("<HH", 0x3FFF, 0x3FFF)
    elif kind == b"VP8L":
        bits = int.from_bytes(out[21:25], "little")
        bits = (bits & ~((1 << 28) - 1)) | 0x3FFF | (0x3FFF << 14)
        out[21:25] = bits.to_bytes(4, "little")
    else:
        raise ValueError(f"WebP chunk {kind!r}")
    return bytes(out)


def _gif_huge(data: bytes) -> bytes:
    return data[:6] + struct.pack("<HH", 65535, 65535) + data[10:]


def _huge(case: FuzzCase) -> bytes:
    if case.data.startswith(b"\xff\xd8"):
        return _jpeg_huge(case.data)
    if case.data.startswith(b"\x89PNG"):
        return forge_png_size(case.data)
    if case.data.startswith(b"GIF"):
        return _gif_huge(case.data)
    return _webp_huge(case.data)


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 4, 32])):
        out[rng.randrange(len(out))] ^= rng.randrange(1, 256)
    return bytes(out)


def not_images() -> list[FuzzCase]:
    """Files that are no image, or not one the decoder reads."""
    eps = (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 24 24\nnewpath 0 0 moveto 24 24 lineto stroke\n%%EOF\n"
    )
    cases = [("empty", "jpg", b""), ("text", "png", b"this is not an image\n" * 4), ("eps", "jpg", eps)]
    return [FuzzCase(name, ext, data, must_fail=True) for name, ext, data in cases]


def fixed_cases() -> list[FuzzCase]:
    """The bombs (seconds to compress) and :func:`not_images`."""
    bombs = [
        FuzzCase("bomb-20000", "png", png_bomb(20000, 20000), must_fail=True),
        # between PIL's two thresholds: PIL alone only warns, and decodes it
        FuzzCase("bomb-12000", "png", png_bomb(12000, 12000), must_fail=True),
    ]
    return [*bombs, *not_images()]


def fuzz_cases(mutations_per_image: int = 4, seed: int = 38) -> list[FuzzCase]:
    """The legitimate images, ``mutations_per_image`` random mutations of each (seeded), their huge-header
    forgeries and the fixed cases."""
    rng = random.Random(seed)
    bases = legitimate_images()
    cases = [*bases, *fixed_cases()]
    for base in bases:
        cases.append(FuzzCase(f"{base.name}-huge-header", base.ext, _huge(base), must_fail=True))
        cases.append(
            FuzzCase(f"{base.name}-cut-in-header", base.ext, base.data[: rng.randrange(1, 12)], True)
        )
        for n in range(mutations_per_image):
            if rng.random() < 0.5:
                data = base.data[: rng.randrange(12, len(base.data))]
                cases.append(FuzzCase(f"{base.name}-cut-{n}", base.ext, data, must_fail=False))
            else:
                cases.append(FuzzCase(f"{base.name}-flip-{n}", base.ext, _flip(base.data, rng), False))
    return cases
