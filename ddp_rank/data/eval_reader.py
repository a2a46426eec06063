"""Sequential reader of an evaluation split, divided across ranks and DataLoader workers.

Evaluation must see every test image exactly once over all ranks, in a fixed order, with no augmentation. The
split's samples (manifest order) are cut into ``world_size`` contiguous ranges, each rank's range into one
contiguous piece per worker, so every piece is read sequentially. Batches carry the sample keys, so the
embeddings gathered from all ranks can be matched up whatever order the workers finish in, and the ``subset``
of each sample from its json (In-Shop: ``query`` / ``gallery``; empty when the dataset has none).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ddp_rank.data.manifest import Manifest
from ddp_rank.data.stream import resolve_rank_world
from ddp_rank.data.tario import MemberReader, SampleEntry, scan_shard
from ddp_rank.data.transforms import TransformConfig, decode_image, normalize_batch, test_transform


def contiguous_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece ``index`` when ``total`` items are cut into ``parts`` near-equal contiguous pieces."""
    return total * index // parts, total * (index + 1) // parts


class EvalShards(IterableDataset):
    """Batches of (images, labels, categories, keys, subsets) of this rank's part of a split."""

    def __init__(
        self,
        shards: str | os.PathLike[str] | Manifest,
        split: str = "test",
        batch_size: int = 256,
        transform: TransformConfig | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        self.manifest = shards if isinstance(shards, Manifest) else Manifest.load(shards)
        self.split = split
        self.shards = self.manifest.split(split).shards
        self.batch_size = batch_size
        self.transform_config = transform or TransformConfig()
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.total = sum(s.samples for s in self.shards)
        self.start, self.stop = contiguous_range(self.total, self.world_size, self.rank)
        self._class_category = np.array(
            [-1 if c.category is None else c.category for c in self.manifest.classes], dtype=np.int64
        )

    @property
    def num_samples(self) -> int:
        """Samples this rank reads (per the manifest)."""
        return self.stop - self.start

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.iter_worker(worker, workers)

    def iter_worker(self, worker: int, num_workers: int) -> Iterator[dict[str, Any]]:
        """Batches of worker ``worker``'s contiguous piece of this rank's range."""
        lo, hi = contiguous_range(self.num_samples, num_workers, worker)
        reader = MemberReader()
        transform = test_transform(self.transform_config)
        pending: list[tuple[Path, SampleEntry]] = []
        try:
            for path, entry in self._entries(self.start + lo, self.start + hi):
                pending.append((path, entry))
                if len(pending) == self.batch_size:
                    yield self._batch(pending, reader, transform)
                    pending = []
            if pending:
                yield self._batch(pending, reader, transform)
        finally:
            reader.close()

    def _entries(self, lo: int, hi: int) -> Iterator[tuple[Path, SampleEntry]]:
        offset = 0
        for shard in self.shards:
            first, last = max(lo, offset), min(hi, offset + shard.samples)
            if first < last:
                path = self.manifest.shard_path(shard)
                scan = scan_shard(path, expected=shard.samples)
                if scan.error is not None:
                    warnings.warn(
                        f"shard {path}: {scan.error}; its unreadable samples are left out", stacklevel=2
                    )
                for entry in scan.samples[first - offset : last - offset]:
                    yield path, entry
            offset += shard.samples

    def _batch(
        self, items: list[tuple[Path, SampleEntry]], reader: MemberReader, transform: Any
    ) -> dict[str, Any]:
        images = []
        subsets = []
        for path, entry in items:
            images.append(
                transform(
                    decode_image(
                        reader.read(path, entry.image_offset, entry.image_size), self.transform_config.resize
                    )
                )
            )
            meta = json.loads(reader.read(path, entry.json_offset, entry.json_size).decode("utf-8"))
            subsets.append(str(meta.get("subset") or ""))
        labels = torch.tensor([e.class_id for _, e in items], dtype=torch.int64)
        return {
            "images": normalize_batch(images, self.transform_config),
            "labels": labels,
            "categories": torch.from_numpy(self._class_category[labels.numpy()]),
            "keys": [e.key for _, e in items],
            "subsets": subsets,
        }
