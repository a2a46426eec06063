"""Shards as other tools write them: ``webdataset.ShardWriter`` with ``maxcount``, samples shuffled, sorted or
interleaved, the class in a ``.cls`` member, a json field or the key's prefix. Also the same images as an image
folder, to build the project's own layout of the same data."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import webdataset as wds
from PIL import Image

FORMATS = (("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP"), ("jpeg", "JPEG"))


@dataclass(frozen=True)
class ForeignSample:
    cls: str
    category: str
    number: int
    """Position of the sample in its class (0, 1, ...), the order of the image folder's files."""
    ext: str
    image: bytes


def foreign_samples(classes_per_category: int = 6, categories: int = 3, seed: int = 0) -> list[ForeignSample]:
    """Classes ``c<cat>x<j>`` of 3 to 8 images of 12 px in categories ``k<cat>``, sorted by class; formats vary."""
    rng = np.random.default_rng(seed)
    out = []
    for c in range(categories):
        for j in range(classes_per_category):
            colour = rng.integers(0, 256, size=3)
            for k in range(int(rng.integers(3, 9))):
                ext, fmt = FORMATS[len(out) % len(FORMATS)]
                pixels = np.clip(colour + rng.integers(0, 64, size=(12, 12, 3)), 0, 255).astype(np.uint8)
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format=fmt, **({"lossless": True} if fmt == "WEBP" else {}))
                out.append(ForeignSample(f"c{c}x{j}", f"k{c}", k, ext, buf.getvalue()))
    return out


def ordered(samples: list[ForeignSample], layout: str, seed: int = 0) -> list[ForeignSample]:
    """The samples in the writer's order: ``sorted`` (by class), ``shuffled`` or ``interleaved`` (round robin
    over the classes: no two samples of a class adjacent)."""
    if layout == "sorted":
        return list(samples)
    if layout == "shuffled":
        order = np.random.default_rng(seed).permutation(len(samples))
        return [samples[i] for i in order]
    if layout == "interleaved":
        by_class: dict[str, list[ForeignSample]] = {}
        for s in samples:
            by_class.setdefault(s.cls, []).append(s)
        queues = list(by_class.values())
        out = []
        while any(queues):
            for q in queues:
                if q:
                    out.append(q.pop(0))
        return out
    raise ValueError(layout)


def write_with_shardwriter(
    root: Path, samples: list[ForeignSample], convention: str, maxcount: int = 25, name: str = "part-%05d.tar"
) -> None:
    """``root/part-%05d.tar`` by ``wds.ShardWriter`` (``name``: another pattern, ``.tar.gz`` compressed as
    webdataset compresses it); ``convention`` says where the class is: ``cls`` (a .cls member), ``txt`` (a .txt
    member), ``json`` (field ``label``) or ``key`` (the key ``<class>_<n>``). The category is the json field
    ``family`` (named with ``--category-field family``)."""
    root.mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(str(root / name), maxcount=maxcount, verbose=0) as sink:
        for n, s in enumerate(samples):
            meta = {"family": s.category}
            record: dict[str, object] = {"__key__": f"s{n:06d}", s.ext: s.image}
            if convention in ("cls", "txt"):
                record[convention] = s.cls
            elif convention == "json":
                meta["label"] = s.cls
            else:
                record["__key__"] = f"{s.cls}_{n:06d}"
            record["json"] = json.dumps(meta)
            sink.write(record)


def index_options(convention: str) -> dict[str, object]:
    """The ``IndexOptions`` keyword arguments that read the class of ``convention``."""
    return {
        "cls": {"category_field": "family"},
        "txt": {"class_field": "txt", "category_field": "family"},
        "json": {"class_field": "label", "category_field": "family"},
        "key": {"class_from_key": "_", "category_field": "family"},
    }[convention]


def write_as_image_folder(root: Path, samples: list[ForeignSample]) -> list[Path]:
    """``root/<category>/<class>/<number>.<ext>``, the input of ``ddp-rank shards build``."""
    paths = []
    for s in samples:
        path = root / s.category / s.cls / f"{s.number:04d}.{s.ext}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(s.image)
        paths.append(path)
    return paths
