"""Sequential reader of an evaluation split, divided across ranks and DataLoader workers.

Evaluation must see every test image exactly once over all ranks, in a fixed order, with no augmentation. The
split's classes (manifest order: shard by shard, class by class) are cut into ``world_size`` contiguous runs of
near-equal image counts, each rank's run into one piece per worker; each class is read with one ranged read per
span (``reader.ClassReader``), from a local directory or a URL. Batches carry the sample keys, so the embeddings
gathered from all ranks can be matched up whatever order the workers finish in, and the ``subset`` of each
sample from its json (In-Shop: ``query`` / ``gallery``; empty when the dataset has none). A class that cannot be
read is left out with a warning (evaluation has no replacement to offer), and so is an image that does not
decode (``decode.decode_image``: the pixel limit of the transform, every PIL failure), by its key.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ddp_rank.data.features.records import decode_vector
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.format.tar_scan import SpanSample
from ddp_rank.data.reading.decode import ImageDecodeError, decode_image
from ddp_rank.data.reading.reader import ClassReadError
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.data.reading.split_source import SplitSource
from ddp_rank.data.reading.transforms import TransformConfig, collate_images, test_transform

log = logging.getLogger(__name__)


def contiguous_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece ``index`` when ``total`` items are cut into ``parts`` near-equal contiguous pieces."""
    return total * index // parts, total * (index + 1) // parts


def balanced_runs(sizes: list[int], parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of the items of run ``index`` when items of these sizes are cut into ``parts`` contiguous
    runs of near-equal total size (a run ends at the first item that reaches its share of the total)."""
    cum = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
    total = int(cum[-1])
    lo = int(np.searchsorted(cum, total * index / parts, side="left"))
    hi = int(np.searchsorted(cum, total * (index + 1) / parts, side="left"))
    return (lo, hi) if index < parts - 1 else (lo, len(sizes))


@dataclass(frozen=True)
class _Class:
    """A class of the split and its image count (the sum over its spans)."""

    id: int
    count: int


@dataclass(frozen=True)
class EvalSplitBatch:
    """One batch of an evaluation split, in sample order."""

    images: torch.Tensor
    """``[n, 3, H, W]``, as the transform leaves them (uint8 or normalised float); ``[n, dim]`` float32 vectors
    for feature shards."""
    labels: torch.Tensor
    """``[n]`` int64 class ids (the manifest's)."""
    categories: torch.Tensor
    """``[n]`` int64 category ids, -1 for a class with none."""
    keys: list[str]
    """The samples' keys: the embeddings gathered from every rank are matched up by them."""
    subsets: list[str]
    """Each sample's ``subset`` from its json (In-Shop: ``query`` / ``gallery``), empty where none."""


class EvalShards(SplitSource):
    """``EvalSplitBatch``es of this rank's part of a split."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Manifest,
        split: str = "test",
        batch_size: int = 256,
        transform: TransformConfig | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        cache_dir: str | os.PathLike[str] | ShardCache | None = None,
    ) -> None:
        super().__init__(shards, split, rank, world_size, cache_dir)
        self.batch_size = batch_size
        self.transform_config = transform or TransformConfig()
        # One entry per class (a class of an indexed split may be several spans), in manifest order.
        self.classes = [
            _Class(cid, sum(span.count for _, span in spans)) for cid, spans in self.reader.where.items()
        ]
        self.total = sum(span.count for span in self.classes)
        self.start, self.stop = balanced_runs([c.count for c in self.classes], self.world_size, self.rank)

    @property
    def num_samples(self) -> int:
        """Samples this rank reads (per the manifest)."""
        return sum(c.count for c in self.classes[self.start : self.stop])

    def __iter__(self) -> Iterator[EvalSplitBatch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.iter_worker(worker, workers)

    def iter_worker(self, worker: int, num_workers: int) -> Iterator[EvalSplitBatch]:
        """Batches of worker ``worker``'s contiguous piece of this rank's classes."""
        mine = self.classes[self.start : self.stop]
        lo, hi = balanced_runs([c.count for c in mine], num_workers, worker)
        transform = test_transform(self.transform_config)
        pending: list[tuple[int, SpanSample]] = []
        try:
            for span in mine[lo:hi]:
                try:
                    samples = self.reader.read(span.id)
                except ClassReadError as exc:
                    log.warning(f"{exc}; its {span.count} image(s) are left out of evaluation")
                    continue
                for sample in samples:
                    pending.append((span.id, sample))
                    if len(pending) == self.batch_size:
                        batch = self._batch(pending, transform)
                        pending = []
                        if batch is not None:
                            yield batch
            batch = self._batch(pending, transform) if pending else None
            if batch is not None:
                yield batch
        finally:
            self.reader.close()

    def _batch(self, items: list[tuple[int, SpanSample]], transform: Any) -> EvalSplitBatch | None:
        """The batch of ``items``, less the images that do not decode (None when none is left)."""
        if self.feature_dim is not None:
            dim = self.feature_dim
            batch = torch.from_numpy(np.stack([decode_vector(s.image, dim) for _, s in items]))
        else:
            images, kept = [], []
            for item in items:
                try:
                    images.append(transform(self._decode(item[1])))
                    kept.append(item)
                except ImageDecodeError as exc:
                    log.warning(f"class {item[0]}: {exc}; left out of evaluation")
            if not kept:
                return None
            items = kept
            batch = collate_images(images, self.transform_config)
        subsets = [
            str(json.loads(s.meta.decode("utf-8")).get("subset") or "") if s.meta else "" for _, s in items
        ]
        labels = torch.tensor([cid for cid, _ in items], dtype=torch.int64)
        return EvalSplitBatch(
            images=batch,
            labels=labels,
            categories=torch.from_numpy(self._class_category[labels.numpy()]),
            keys=[s.key for _, s in items],
            subsets=subsets,
        )

    def _decode(self, sample: SpanSample) -> Any:
        config = self.transform_config
        return decode_image(
            sample.image, config.resize, name=f"{sample.key}.{sample.image_ext}", max_pixels=config.max_pixels
        )
