"""Synthetic feature shards (``data.features.records``): clustered float16 vectors written straight to shards.

For tests of the feature path and for benchmarks of a training step at global batches far beyond what the
machine could embed: class centres scattered around their category's centre (so a category's classes are each
other's hard negatives), samples scattered around their class centre. The vectors are a pure function of the
arguments; the manifest's ``build.features`` record names the ``synthetic`` backbone, which no image can be
embedded with (``search`` of an image refuses it).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ddp_rank.data.features.records import BUILD_KEY, FEATURE_EXTENSION, encode_vector
from ddp_rank.data.format.manifest import ClassInfo, Manifest, ShardInfo, SplitInfo
from ddp_rank.data.format.tar_writer import shard_writer

__all__ = ["synthetic_record", "write_feature_shards"]


def synthetic_record(dim: int, seed: int) -> dict[str, object]:
    """The ``build.features`` record of synthetic vectors."""
    return {
        "backbone": "synthetic",
        "weights": "none",
        "pooling": "default",
        "weights_digest": f"synthetic-seed-{seed}",
        "dim": dim,
        "transform": {"crop": "random_resized", "resize_size": 0, "image_size": 0},
        "mixed_precision": "no",
        "init_seed": seed,
        "source": "synthetic",
    }


def write_feature_shards(
    out: str | os.PathLike[str],
    classes_per_category: Sequence[int],
    images: int,
    dim: int,
    test_every: int = 3,
    val_every: int = 0,
    class_spread: float = 0.6,
    noise: float = 0.5,
    max_samples: int = 50_000,
    seed: int = 0,
) -> Path:
    """Write feature shards to ``out``: ``classes_per_category[c]`` classes of ``images`` vectors of ``dim`` in
    category c; every ``test_every``-th class of a category goes to the ``test`` split (0: no test split), and of
    the others every ``val_every``-th to the ``val`` split (0: none, the default). Returns ``out``."""
    if val_every == 1:
        raise ValueError("val_every=1 would leave no training class: give 0 (no val split) or 2 and more")
    rng = np.random.default_rng(seed)
    root = Path(out)
    categories = [f"cat{c}" for c in range(len(classes_per_category))]
    classes: list[ClassInfo] = []
    members: dict[str, dict[int, list[int]]] = {
        "train": {},
        "val": {},
        "test": {},
    }  # split -> category -> ids
    for c, n in enumerate(classes_per_category):
        for j in range(n):
            split = "test" if test_every and j % test_every == test_every - 1 else "train"
            if split == "train" and val_every and j % val_every == val_every - 2:
                split = "val"
            members[split].setdefault(c, []).append(len(classes))
            classes.append(ClassInfo(len(classes), f"cls{c}_{j}", c))
    category_centres = rng.standard_normal((len(categories), dim))
    category_of = np.array([c.category for c in classes], dtype=np.int64)
    class_centres = category_centres[category_of] + class_spread * rng.standard_normal((len(classes), dim))
    splits = {}
    for split, by_category in members.items():
        shards: list[ShardInfo] = []
        for c, ids in sorted(by_category.items()):
            per_shard = max(1, max_samples // images)
            for index, start in enumerate(range(0, len(ids), per_shard)):
                chunk = ids[start : start + per_shard]
                rel = f"{split}/{split}-c{c:04d}-{index:05d}.tar"
                (root / split).mkdir(parents=True, exist_ok=True)
                with shard_writer(root / rel) as writer:
                    for cid in chunk:
                        vectors = class_centres[cid] + noise * rng.standard_normal((images, dim))
                        for k, v in enumerate(vectors):
                            meta = {
                                "class": classes[cid].name,
                                "category": categories[c],
                                "source": "synthetic",
                            }
                            writer.add(f"c{cid:07d}_{k:05d}", FEATURE_EXTENSION, encode_vector(v), cid, meta)
                    nbytes, digest = writer.close()
                shards.append(ShardInfo(rel, c, tuple(writer.spans), writer.samples, nbytes, digest))
        if shards:
            counts = {cid: images for ids in by_category.values() for cid in ids}
            splits[split] = SplitInfo(split, counts, tuple(shards))
    manifest = Manifest(
        categories=tuple(categories),
        classes=tuple(classes),
        splits=splits,
        build={BUILD_KEY: synthetic_record(dim, seed)},
        root=str(root),
    )
    manifest.save(root)
    return root
