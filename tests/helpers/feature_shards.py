"""Helpers of the feature-shard tests: a well-formed build.features record."""

from __future__ import annotations

from typing import Any

RECORD: dict[str, Any] = {
    "backbone": "tiny_cnn",
    "weights": "none",
    "pooling": "default",
    "weights_digest": "0" * 64,
    "dim": 128,
    "transform": {"crop": "random_resized", "resize_size": 16, "image_size": 16},
    "mixed_precision": "no",
    "init_seed": 0,
    "source": "/data/shards",
}
