"""Decoding: every stored image comes out as 8-bit RGB with its own tones."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddp_rank.data.building.build import BuildOptions, image_bytes
from ddp_rank.data.reading.transforms import decode_image


def _png(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_16_bit_grey_png_keeps_its_tones() -> None:
    """A 16-bit grey PNG (PIL mode I;16) is scaled to 8 bits, not clipped at 255 (which made it nearly white)."""
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    data = _png(ramp)
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    decoded = decode_image(data)
    assert decoded.mode == "RGB"
    pixels = np.asarray(decoded).astype(np.int64)
    expected = np.round(ramp / 257).astype(np.int64)
    assert np.abs(pixels - expected[..., None]).max() <= 1
    assert (pixels == 255).mean() < 0.01


def test_8_bit_images_are_unchanged() -> None:
    rgb = np.random.default_rng(0).integers(0, 256, size=(8, 8, 3), dtype=np.uint8)
    assert np.array_equal(np.asarray(decode_image(_png(rgb))), rgb)
    grey = rgb[..., 0]
    assert np.array_equal(np.asarray(decode_image(_png(grey))), np.repeat(grey[..., None], 3, axis=2))


@pytest.mark.parametrize(("resize", "image_format"), [(16, None), (None, "jpg"), (None, "webp")])
def test_shard_build_reencodes_16_bit_grey_with_its_tones(
    tmp_path: Path, resize: int | None, image_format: str | None
) -> None:
    """``shards build --resize / --format`` re-encodes through the same 16-to-8-bit scaling as training."""
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    path = tmp_path / "grey16.png"
    path.write_bytes(_png(ramp))
    data, _ = image_bytes(str(path), BuildOptions(resize=resize, image_format=image_format, progress=False))
    pixels = np.asarray(decode_image(data)).astype(np.int64)
    assert pixels.min() < 20 and pixels.max() > 230, "the dark end of the ramp survives"
    assert (pixels >= 250).mean() < 0.1
