"""Pixel formats that need more than PIL's ``convert``: shared by shard building and training-time decoding,
without torch (``shards build`` does not import it)."""

from __future__ import annotations

import numpy as np
from PIL import Image


def is_grey16(image: Image.Image) -> bool:
    """A 16-bit grey image (PIL mode ``I;16*``, or ``I`` as PIL opens 16-bit PNGs)."""
    return image.mode == "I" or image.mode.startswith("I;16")


def grey16_to_l(image: Image.Image) -> Image.Image:
    """A 16-bit grey image as 8-bit ``L``: 0-65535 onto 0-255, rounded (65535 / 255 = 257). PIL's own
    conversion clips the values at 255, which turns almost every pixel white. int32 holds every value PIL gives
    (its ``I`` mode is int32), at half the memory of int64 on a large image."""
    values = np.clip(np.asarray(image, dtype=np.int32), 0, 65535)
    return Image.fromarray(((values + 128) // 257).astype(np.uint8))  # 2-D uint8: mode L
