"""Manifests with the category and class sizes of the real datasets, for planning tests (no images, no tars).

Totals from the papers: SOP train 11,318 classes / 59,551 images in 12 categories, 2-12 images a class (FastAP
sec. 5); In-Shop train 3,997 classes / 25,882 images in 23 categories; VehicleID train 13,134 classes /
110,178 images, 250 labelled models covering roughly half of it; iNaturalist 2018 as split by Smooth-AP for
metric learning: 5,690 train classes / 325,846 images in 13 supercategories, long-tailed. How the classes spread
over the categories is drawn (seeded) around those totals: only the totals and the ranges are the datasets'.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddp_rank.data.format.manifest import ClassInfo, ClassSpan, Manifest, ShardInfo, SplitInfo


def _fit(sizes: np.ndarray, total: int, low: int, high: int) -> np.ndarray:
    """Nudge class sizes (within [low, high]) until they add up to ``total``."""
    sizes = sizes.clip(low, high).astype(np.int64)
    rng = np.random.default_rng(1)
    while (gap := total - int(sizes.sum())) != 0:
        i = rng.integers(len(sizes), size=min(abs(gap), len(sizes)))
        sizes[i] = (sizes[i] + np.sign(gap)).clip(low, high)
    return sizes


def _manifest(name: str, category_of: list[int | None], sizes: np.ndarray, categories: list[str]) -> Manifest:
    classes = tuple(ClassInfo(i, f"{name}-{i}", c) for i, c in enumerate(category_of))
    shards = []
    by_category: dict[int | None, list[int]] = {}
    for cid, c in enumerate(category_of):
        by_category.setdefault(c, []).append(cid)
    for c, members in by_category.items():
        for start in range(0, len(members), 500):
            spans, offset = [], 0
            for cid in members[start : start + 500]:
                n = int(sizes[cid])
                spans.append(ClassSpan(cid, n, offset, n * 4096, "0" * 32))
                offset += n * 4096
            label = "unlabelled" if c is None else f"c{c:04d}"
            shards.append(
                ShardInfo(
                    f"train/{label}-{start:06d}.tar",
                    c,
                    tuple(spans),
                    sum(s.count for s in spans),
                    offset,
                    "0" * 64,
                )
            )
    counts = {cid: int(n) for cid, n in enumerate(sizes)}
    return Manifest(tuple(categories), classes, {"train": SplitInfo("train", counts, tuple(shards))})


def sop() -> Manifest:
    rng = np.random.default_rng(0)
    category_of = [int(c) for c in np.sort(rng.integers(0, 12, size=11_318))]
    sizes = _fit(rng.integers(2, 10, size=11_318), 59_551, 2, 12)
    names = [
        "bicycle",
        "cabinet",
        "chair",
        "coffee_maker",
        "fan",
        "kettle",
        "lamp",
        "mug",
        "sofa",
        "stapler",
        "table",
        "toaster",
    ]
    return _manifest("sop", category_of, sizes, names)


def inshop() -> Manifest:
    rng = np.random.default_rng(0)
    category_of = [int(c) for c in np.sort(rng.integers(0, 23, size=3_997))]
    sizes = _fit(rng.integers(2, 12, size=3_997), 25_882, 2, 20)
    return _manifest("inshop", category_of, sizes, [f"category-{i:02d}" for i in range(23)])


def vehicleid() -> Manifest:
    rng = np.random.default_rng(0)
    sizes = _fit(rng.integers(2, 15, size=13_134), 110_178, 2, 40)
    labelled = rng.random(13_134) < 0.5
    models = rng.integers(0, 250, size=13_134)
    category_of: list[int | None] = [int(m) if lab else None for m, lab in zip(models, labelled)]
    return _manifest("vehicleid", category_of, sizes, [f"model-{i:03d}" for i in range(250)])


INAT_SUPERCATEGORIES = (
    "Actinopterygii",
    "Amphibia",
    "Animalia",
    "Arachnida",
    "Aves",
    "Chromista",
    "Fungi",
    "Insecta",
    "Mammalia",
    "Mollusca",
    "Plantae",
    "Protozoa",
    "Reptilia",
)
"""iNaturalist 2018's supercategories (Bacteria, with one class, is not in the metric-learning train split)."""


def inat() -> Manifest:
    rng = np.random.default_rng(0)
    # Approximately the 2018 challenge's training images per supercategory (Aves, Plantae, Insecta dominate).
    share = np.array([1982, 15318, 5228, 4873, 214295, 398, 5835, 100479, 29333, 7536, 158407, 308, 35201])
    category_of = [int(c) for c in np.sort(rng.choice(13, size=5_690, p=share / share.sum()))]
    sizes = _fit(np.round(rng.lognormal(3.6, 0.9, size=5_690)), 325_846, 2, 1_000)
    return _manifest("inat", category_of, sizes, list(INAT_SUPERCATEGORIES))


def emoji() -> Manifest:
    """The demo set: about 955 train classes of 4 vendor images in 10 categories."""
    rng = np.random.default_rng(0)
    category_of = [int(c) for c in np.sort(rng.integers(0, 10, size=955))]
    return _manifest("emoji", category_of, np.full(955, 4), [f"group-{i}" for i in range(10)])


def words() -> Manifest:
    """The word set: 20,802 training words of 8 images (one a font) in 125 categories of first letter and
    length, from a handful of words to about a thousand each (docs/tutorials/own-shards.md, "A large set that installs offline")."""
    rng = np.random.default_rng(0)
    share = rng.lognormal(5.0, 1.0, size=125)
    category_of = [int(c) for c in np.sort(rng.choice(125, size=20_802, p=share / share.sum()))]
    return _manifest("words", category_of, np.full(20_802, 8), [f"category-{i:03d}" for i in range(125)])


def cub() -> Manifest:
    """CUB-200-2011's train half (Oh Song et al. 2016): classes 1-100, 5,864 images, no categories."""
    sizes = _fit(np.random.default_rng(0).integers(41, 61, size=100), 5_864, 41, 60)
    return _manifest("cub", [None] * 100, sizes, [])


def cars() -> Manifest:
    """Cars196's train half (Oh Song et al. 2016): classes 1-98, 8,054 images, no categories."""
    sizes = _fit(np.random.default_rng(0).integers(40, 125, size=98), 8_054, 24, 140)
    return _manifest("cars", [None] * 98, sizes, [])


SHAPES = {
    "sop": sop,
    "inshop": inshop,
    "vehicleid": vehicleid,
    "inat": inat,
    "demo": emoji,
    "words": words,
    "cub": cub,
    "cars": cars,
}


def write(shape: str, directory: Path) -> Path:
    """Save the manifest of ``shape`` under ``directory``; returns it (what ``data.shards`` points at)."""
    directory.mkdir(parents=True, exist_ok=True)
    SHAPES[shape]().save(directory)
    return directory
