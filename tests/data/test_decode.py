"""The one image decoder (``ddp_rank.data.reading.decode``): the pixel limit is read from the header before any pixel
is decoded, whatever PIL's own limit says; every failure is one ``ImageDecodeError`` naming the image."""

from __future__ import annotations

import io
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddp_rank.config import ConfigError, load_config
from ddp_rank.data.building.build import check_image
from ddp_rank.data.reading.decode import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageDecodeError,
    decode_image,
    open_image_header,
)
from ddp_rank.data.reading.transforms import transform_from_config
from tests.helpers.image_fuzz import FuzzCase, forge_png_size, not_images


def _png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((side, side, 3), 90, dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def test_the_limit_is_checked_from_the_header_before_any_pixel() -> None:
    """A 30,000 x 30,000 header over 24 x 24 pixels of data: were the pixels decoded first, the error would be
    a truncated file; it is the limit, named, at once, and with no warning from PIL first."""
    forged = forge_png_size(_png(24))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # PIL's DecompressionBombWarning would raise here
        start = time.perf_counter()
        with pytest.raises(ImageDecodeError) as caught:
            decode_image(forged, name="shard-0/key7.png")
        assert time.perf_counter() - start < 0.5
    assert str(caught.value) == (
        "image shard-0/key7.png does not decode: 30000 x 30000 = 900,000,000 pixels is over the limit of "
        "89,478,485 (a decompression bomb, or a larger image than expected: raise data.max_image_pixels / "
        "--max-image-pixels to accept it)"
    )
    assert isinstance(caught.value, ValueError) and caught.value.name == "shard-0/key7.png"


def test_the_limit_is_the_users_whatever_pils_own_says() -> None:
    """Below and above PIL's thresholds (89.5 and 179 million pixels) alike: PIL's check is off, ours is set."""
    assert Image.MAX_IMAGE_PIXELS is None
    with pytest.raises(ImageDecodeError, match="100 x 100 = 10,000 pixels is over the limit of 9,999"):
        decode_image(_png(100), max_pixels=9_999)
    assert decode_image(_png(100), max_pixels=10_000).size == (100, 100)
    with open_image_header(
        forge_png_size(_png(24)), "forged", max_pixels=10**9
    ) as image:  # 5 x PIL's error limit
        assert image.size == (30000, 30000)
    with pytest.raises(ValueError, match="positive"):
        decode_image(_png(4), max_pixels=0)


@pytest.mark.parametrize("case", not_images(), ids=lambda c: c.name)
def test_files_that_are_no_image_are_named(case: FuzzCase) -> None:
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(case.data, name="q.jpg")
    assert str(caught.value).startswith(
        "image q.jpg does not decode: not an image in a format read here (JPEG"
    )
    assert "\n" not in str(caught.value)


def test_a_cut_file_is_named_without_object_reprs() -> None:
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(_png(64)[:60], name="cut.png")
    assert caught.value.reason.startswith("OSError: ") and "0x" not in str(caught.value)


def test_the_config_key_owns_the_limit() -> None:
    cfg = load_config(None, [])
    assert cfg.data.max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    assert transform_from_config(load_config(None, ["data.max_image_pixels=1000"]).data).max_pixels == 1000
    with pytest.raises(ConfigError, match="max_image_pixels"):
        load_config(None, ["data.max_image_pixels=0"])


def test_shards_build_drops_an_image_over_the_limit(tmp_path: Path) -> None:
    (tmp_path / "forged.png").write_bytes(forge_png_size(_png(24)))
    (tmp_path / "fine.png").write_bytes(_png(24))
    assert check_image(str(tmp_path / "fine.png")) is None
    assert "30000 x 30000 = 900,000,000 pixels is over the limit" in (
        check_image(str(tmp_path / "forged.png")) or ""
    )
