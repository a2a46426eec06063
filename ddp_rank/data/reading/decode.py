"""The one image decoder of ddp_rank: every path that turns image bytes into pixels goes through here (the
training stream, the evaluation reader, ``shards verify``, ``shards build``, ``export``, ``search``, feature
builds, ``shards reshard --decode``, the retrieval pictures), so every path bounds memory the same way and fails
the same way; each passes the user's limit (``data.max_image_pixels`` / ``--max-image-pixels``).

- **A pixel limit, checked from the header.** ``Image.open`` reads only the header; its width x height is
  compared with ``max_pixels`` (``data.max_image_pixels``, ``--max-image-pixels``) before a pixel is decoded,
  so a decompression bomb (a 20,000 x 20,000 one-bit PNG is 48 KB) costs microseconds and no memory. PIL's own
  check (``Image.MAX_IMAGE_PIXELS``) cannot stand in for it: it is one process-wide number, it only warns
  between its two thresholds (so a 100-megapixel image is decoded, at 300 MB, with a warning) and raises a plain
  ``Exception`` above twice the number. It is read inside ``Image.open``, so it cannot be set per call
  without racing other threads. Importing this module therefore sets ``Image.MAX_IMAGE_PIXELS = None`` for the
  WHOLE PROCESS (every process that imports it, DataLoader workers included), and the header check above
  replaces PIL's in every decode ddp_rank does, whichever value the user sets, with no warning before it. A
  library user's own ``Image.open`` calls in the same process lose PIL's check: they should decode through
  :func:`decode_image` (or :func:`open_image_header`), or set ``Image.MAX_IMAGE_PIXELS`` themselves after
  importing ddp_rank.
- **Formats the data layer stores**: JPEG (PIL's JPEG reader also opens cameras' multi-picture JPEGs), PNG,
  WebP, and GIF, BMP and TIFF, which ``shards build`` accepts in image folders. PIL's other ~40 formats are sniffed from the bytes
  whatever the file's name, and one of them (EPS) runs Ghostscript: they are refused by name instead.
- **Every failure named.** PIL's plugins parse hostile bytes and raise what they meet: ``OSError`` (truncated
  data), ``UnidentifiedImageError``, ``SyntaxError``, ``ValueError`` (unsupported modes, huge text chunks),
  ``EOFError``, ``struct.error``, ``IndexError``, ``DecompressionBombError``... Each becomes one
  :class:`ImageDecodeError` that names the image and the reason in words, which every caller catches (the
  stream replaces the class and counts it, ``search`` and ``export`` print a line per file).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ddp_rank.data.reading.image_modes import grey16_to_l, is_grey16

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "IMAGE_FORMATS",
    "ImageDecodeError",
    "check_image_file",
    "decode_image",
    "open_image_header",
]

DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""The default limit: PIL's own warning threshold (a quarter GiB of 24-bit pixels, 9,459 x 9,459), about 270 MB
once decoded to RGB. Raise it (``data.max_image_pixels``) for collections of larger photographs."""

IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""PIL format names the decoder opens; any other format is refused without being parsed further."""

Image.MAX_IMAGE_PIXELS = (
    None  # process-wide, on import: the header check replaces it (see the module docstring)
)

_OBJECT_REPR = re.compile(r"\s*<[^<>]* at 0x[0-9a-fA-F]+>")


class ImageDecodeError(ValueError):
    """An image that cannot be decoded (or is over the pixel limit): ``name`` is the file or sample, ``reason``
    why, in words; ``str()`` is one line with both."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason
        super().__init__(f"image {name} does not decode: {reason}")


def failure_reason(exc: BaseException) -> str:
    """Why PIL failed, in words: its messages carry object reprs (``<_io.BytesIO object at 0x...>``) instead
    of the file, which the caller names, and some run over several lines."""
    if isinstance(exc, UnidentifiedImageError):
        return f"not an image in a format read here ({', '.join(IMAGE_FORMATS)})"
    text = _OBJECT_REPR.sub("", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _limit_reason(size: tuple[int, int], max_pixels: int) -> str | None:
    width, height = size
    pixels = max(1, width) * max(1, height)
    if pixels <= max_pixels:
        return None
    return (
        f"{width} x {height} = {pixels:,} pixels is over the limit of {max_pixels:,} (a decompression bomb, or "
        "a larger image than expected: raise data.max_image_pixels / --max-image-pixels to accept it)"
    )


def _check_limit(max_pixels: int) -> None:
    if not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < 1:
        raise ValueError(f"max_pixels must be a positive number of pixels, got {max_pixels!r}")


def open_image_header(
    source: bytes | str | os.PathLike[str], name: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> Image.Image:
    """The image opened (its header read, no pixel decoded) and checked against ``max_pixels``.

    Raises :class:`ImageDecodeError` (naming ``name``) for anything PIL cannot open, a format outside
    :data:`IMAGE_FORMATS`, or a size over the limit. The caller closes the image (``with``)."""
    _check_limit(max_pixels)
    fp = io.BytesIO(source) if isinstance(source, bytes | bytearray) else Path(source)
    try:
        image = Image.open(fp, formats=IMAGE_FORMATS)
    except Exception as exc:  # PIL's plugins raise any kind on hostile bytes
        raise ImageDecodeError(name, failure_reason(exc)) from exc
    reason = _limit_reason(image.size, max_pixels)
    if reason is not None:
        image.close()
        raise ImageDecodeError(name, reason)
    return image


def decode_image(
    data: bytes,
    draft_size: int | None = None,
    *,
    name: str = "image",
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> Image.Image:
    """Decode image bytes to RGB; with ``draft_size`` a JPEG is decoded at the smallest scale >= that size.

    The size is checked against ``max_pixels`` from the header, before any pixel is decoded; every failure
    raises :class:`ImageDecodeError` naming ``name`` (a sample key, a file path). Transparent images (emoji
    artwork) are laid on white: a plain RGB conversion would expose whatever colour the transparent pixels
    happen to store, usually black. 16-bit grey images (PNG) are scaled to 8 bits first: PIL's RGB conversion
    clips their 0-65535 values at 255, which turns almost every pixel white. (PIL already reads 16-bit colour
    PNGs as 8-bit RGB / RGBA.) An animated image gives its first frame.
    """
    with open_image_header(data, name, max_pixels) as opened:
        try:
            return _to_rgb(opened, draft_size)
        except Exception as exc:  # as above: truncated data, odd modes, plugin errors
            raise ImageDecodeError(name, failure_reason(exc)) from exc


def _to_rgb(opened: Image.Image, draft_size: int | None) -> Image.Image:
    if draft_size is not None and opened.format == "JPEG":
        opened.draft("RGB", (draft_size, draft_size))
    image: Image.Image = opened
    if is_grey16(image):
        image = grey16_to_l(image)
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def check_image_file(path: str | os.PathLike[str], max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> str | None:
    """None if the file at ``path`` opens within the limit and PIL's ``verify`` finds its data whole, else the
    reason in words (cheaper than a decode: ``shards build`` checks every file of a folder with it)."""
    try:
        with open_image_header(path, str(path), max_pixels) as image:
            image.verify()
    except ImageDecodeError as exc:
        return exc.reason
    except Exception as exc:  # verify raises what the plugin meets
        return failure_reason(exc)
    return None
