"""Small synthetic image collections, for tests, benchmarks and smoke runs without any dataset.

Each class gets its own colour pattern so images differ (the build and verify code see realistic, decodable
files) and the output is a pure function of the arguments.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image


def write_image_folder(
    root: str | os.PathLike[str],
    class_sizes: Sequence[Sequence[int]],
    image_size: int = 8,
    image_format: str = "png",
    seed: int = 0,
) -> list[Path]:
    """Write ``root/cat<i>/cls<i>_<j>/<k>.<ext>``: ``class_sizes[i][j]`` images for class j of category i.

    Returns the written paths in order. ``image_format`` is ``png`` or ``jpg``.
    """
    rng = np.random.default_rng(seed)
    base = Path(root)
    paths = []
    for c, sizes in enumerate(class_sizes):
        for j, n in enumerate(sizes):
            folder = base / f"cat{c}" / f"cls{c}_{j}"
            folder.mkdir(parents=True, exist_ok=True)
            colour = rng.integers(0, 256, size=3)
            for k in range(n):
                noise = rng.integers(0, 64, size=(image_size, image_size, 3))
                pixels = np.clip(colour + noise, 0, 255).astype(np.uint8)
                path = folder / f"{k:04d}.{image_format}"
                if image_format == "jpg":
                    Image.fromarray(pixels).save(path, quality=90)
                else:
                    Image.fromarray(pixels).save(path)
                paths.append(path)
    return paths
