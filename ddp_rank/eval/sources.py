"""What ``ddp-rank export`` and ``ddp-rank search`` embed: a split of a shard directory, an image folder, or
WebDataset shards at a URL (or a local path pattern), each read by rank with the test-time transform. Shards are
read through the data layer only (``EvalShards`` for a split, ``NamedShards`` for a pattern): the manifest's
checks, the retries and the node-local cache hold for every source.

Every source yields :class:`ImageBatch` objects (pixels in [0, 1], as the models take them) with the sample
keys, class labels (``-1`` where a source has none), category names and subsets (``""`` where none). Each rank
reads its own contiguous part (a split, an image folder) or every W-th shard (URL shards), so the ranks read
disjoint parts that cover the source once.

Only images, ``.cls`` and ``.json`` are decoded (never pickles), as in the data layer, and images only by
``ddp_rank.data.reading.decode`` (the pixel limit of the transform, every decoder failure named): an image file or URL
sample that does not decode is an error naming it, or, given a ``skipped`` list (``--on-bad skip``), left out and
recorded there as ``name: why``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import DataLoader

from ddp_rank.data.reading.decode import ImageDecodeError, decode_image, failure_reason
from ddp_rank.data.reading.eval_reader import EvalShards, contiguous_range
from ddp_rank.data.reading.loader import ignore_stop_signals
from ddp_rank.data.reading.named_shards import NamedShards, ShardReadError, ShardSample
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.data.reading.transforms import TransformConfig, normalize_batch, test_transform

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageBatch",
    "SourceError",
    "decode_or_skip",
    "folder_batches",
    "image_batches",
    "list_images",
    "open_image",
    "pil_batch",
    "split_batches",
    "url_shard_batches",
]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")


class SourceError(ValueError):
    """A source that cannot be read as asked; the message says what to pass instead."""


@dataclass
class ImageBatch:
    """``images [n, 3, H, W]`` in [0, 1] and, per image, its key, label (-1: none), category and subset."""

    images: torch.Tensor
    keys: list[str]
    labels: list[int]
    categories: list[str]
    subsets: list[str]


def split_batches(
    shards: str | os.PathLike[str],
    split: str,
    transform: TransformConfig,
    batch_size: int,
    rank: int,
    world: int,
    num_workers: int = 0,
    cache_dir: str | os.PathLike[str] | ShardCache | None = None,
) -> Iterator[ImageBatch]:
    """This rank's part of ``split`` of a ddp_rank shard directory or URL (the evaluation's own reader, with
    the node-local ``cache_dir`` for a URL's shards)."""
    reader = EvalShards(
        shards,
        split=split,
        batch_size=batch_size,
        transform=transform,
        rank=rank,
        world_size=world,
        cache_dir=cache_dir,
    )
    names = reader.manifest.categories
    loader = DataLoader(reader, batch_size=None, num_workers=num_workers, worker_init_fn=ignore_stop_signals)
    for b in loader:
        yield ImageBatch(
            images=b.images,
            keys=list(b.keys),
            labels=[int(v) for v in b.labels],
            categories=[names[c] if c >= 0 else "" for c in b.categories.tolist()],
            subsets=list(b.subsets),
        )


def list_images(root: str | os.PathLike[str]) -> list[Path]:
    """Image files under ``root`` (recursively), sorted, so every rank sees the same list."""
    base = Path(root)
    if not base.is_dir():
        raise SourceError(
            f"image folder '{root}' does not exist; pass a directory of .jpg / .png / .webp files"
        )
    found = sorted(
        p for p in base.rglob("*") if p.is_file() and p.suffix.lower().lstrip(".") in IMAGE_EXTENSIONS
    )
    if not found:
        raise SourceError(f"image folder '{root}' holds no image ({', '.join(IMAGE_EXTENSIONS)})")
    return found


def _transform_batch(images: Sequence[Image.Image], transform: TransformConfig) -> torch.Tensor:
    crop = test_transform(transform)
    return normalize_batch([crop(im) for im in images], transform)


SKIP_HINT = "remove it, or pass --on-bad skip to leave such files out"


def decode_or_skip(
    data: bytes | None, name: str, transform: TransformConfig, skipped: list[str] | None, draft: bool = True
) -> Image.Image | None:
    """``data`` decoded (``None``: read the file ``name``), a JPEG at the transform's scale unless ``draft`` is
    off; a failure raises :class:`SourceError` naming ``name``, or with a ``skipped`` list is recorded there
    (``name: why``) and gives None."""
    try:
        if data is None:
            data = Path(name).read_bytes()
        size = transform.resize if draft else None
        return decode_image(data, size, name=name, max_pixels=transform.max_pixels)
    except (ImageDecodeError, OSError) as exc:
        if isinstance(exc, ImageDecodeError):
            why, message = exc.reason, str(exc)
        else:  # the file itself: missing, a folder, no permission
            why = f"cannot be read ({failure_reason(exc)})"
            message = f"image {name} {why}"
        if skipped is None:
            raise SourceError(f"{message}; {SKIP_HINT}") from exc
        skipped.append(f"{name}: {why}")
        return None


def image_batches(
    paths: Sequence[str | os.PathLike[str]],
    transform: TransformConfig,
    batch_size: int,
    root: Path | None = None,
    skipped: list[str] | None = None,
) -> Iterator[ImageBatch]:
    """Batches of the image files ``paths`` (keys: the path relative to ``root``, or as given).

    An unreadable file raises :class:`SourceError` naming it; with a ``skipped`` list it is left out and
    recorded there instead (``path: why``), as ``--on-bad skip`` asks."""
    for start in range(0, len(paths), batch_size):
        chunk = []
        images = []
        for p in (Path(q) for q in paths[start : start + batch_size]):
            image = decode_or_skip(None, str(p), transform, skipped)
            if image is not None:
                images.append(image)
                chunk.append(p)
        if not chunk:
            continue
        yield ImageBatch(
            images=_transform_batch(images, transform),
            keys=[str(p.relative_to(root)) if root is not None else str(p) for p in chunk],
            labels=[-1] * len(chunk),
            categories=[""] * len(chunk),
            subsets=[""] * len(chunk),
        )


def folder_batches(
    root: str | os.PathLike[str],
    transform: TransformConfig,
    batch_size: int,
    rank: int,
    world: int,
    skipped: list[str] | None = None,
) -> Iterator[ImageBatch]:
    """This rank's contiguous part of the images under ``root`` (keys relative to ``root``); unreadable files
    are an error, or left out and listed in ``skipped`` when one is given."""
    paths = list_images(root)
    lo, hi = contiguous_range(len(paths), world, rank)
    yield from image_batches(paths[lo:hi], transform, batch_size, root=Path(root), skipped=skipped)


def _sample_fields(sample: ShardSample) -> tuple[bytes, int, str, str] | None:
    """(image bytes, label, category, subset) of a shard's sample, or None when it holds no image."""
    members = sample.members
    image = next((members[e] for e in IMAGE_EXTENSIONS if e in members), None)
    if image is None:
        return None
    cls = members.get("cls")
    label = int(cls.decode().strip()) if cls is not None and cls.strip() else -1
    meta_raw = members.get("json")
    meta = json.loads(meta_raw.decode("utf-8")) if meta_raw is not None else {}
    return image, label, str(meta.get("category") or ""), str(meta.get("subset") or "")


def url_shard_batches(
    url: str,
    transform: TransformConfig,
    batch_size: int,
    rank: int,
    world: int,
    skipped: list[str] | None = None,
    cache_dir: str | os.PathLike[str] | ShardCache | None = None,
) -> Iterator[ImageBatch]:
    """WebDataset shards at ``url`` (brace patterns expand; any URL fsspec reads, or local paths), read through
    the data layer's checked path (``data.reading.named_shards``: the manifest's size and sha256 where one lists them,
    retries, the node-local ``cache_dir``): rank r reads shards r, r + W, ... in order. Keys are the samples'
    ``__key__``; a shard that cannot be read is an error naming it, and a sample whose image does not decode is
    an error, or left out and listed in ``skipped`` when one is given."""
    try:
        shards = NamedShards(url, cache_dir=cache_dir)
    except ShardReadError as exc:
        raise SourceError(str(exc)) from exc
    pending: list[tuple[str, Image.Image, int, str, str]] = []

    def flush() -> ImageBatch:
        return ImageBatch(
            images=_transform_batch([p[1] for p in pending], transform),
            keys=[p[0] for p in pending],
            labels=[p[2] for p in pending],
            categories=[p[3] for p in pending],
            subsets=[p[4] for p in pending],
        )

    try:
        for shard in shards.urls[rank::world]:
            for sample in shards.samples(shard):
                try:
                    fields = _sample_fields(sample)
                except ValueError as exc:  # a .cls that is no number, a .json that does not parse
                    raise SourceError(
                        f"sample {sample.key} of {shard}: its .cls or .json does not read ({exc}); fix the "
                        "shard, or leave it out of the pattern"
                    ) from exc
                if fields is None:
                    continue
                image = decode_or_skip(fields[0], sample.key, transform, skipped)
                if image is None:
                    continue
                pending.append((sample.key, image, *fields[1:]))
                if len(pending) == batch_size:
                    yield flush()
                    pending = []
    except ShardReadError as exc:
        raise SourceError(str(exc)) from exc
    finally:
        shards.close()
    if pending:
        yield flush()


def open_image(
    path: str | os.PathLike[str], transform: TransformConfig | None = None, skipped: list[str] | None = None
) -> Image.Image | None:
    """One query image, decoded like the shards' images (transparency laid on white, the pixel limit of
    ``transform``); a bad file is an error naming it, or with a ``skipped`` list recorded there (None)."""
    return decode_or_skip(
        None, str(path), transform or TransformConfig(), skipped, draft=transform is not None
    )


def pil_batch(images: Sequence[Image.Image], transform: TransformConfig) -> torch.Tensor:
    """Already-decoded images as one model input batch (test-time transform, pixels in [0, 1])."""
    return _transform_batch([im.convert("RGB") for im in images], transform)
