"""What every reader of one split of a shard set sets up on its rank: the base of the training stream
(``stream.ShardStream``) and of the evaluation reader (``eval_reader.EvalShards``)."""

from __future__ import annotations

import os

import numpy as np
import torch.distributed as dist
from torch.utils.data import IterableDataset

from ddp_rank.data.features.records import feature_dim
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.reader import ClassReader
from ddp_rank.data.reading.shard_cache import ShardCache

__all__ = ["SplitSource", "resolve_rank_world"]


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Explicit values first, then an initialised process group, then RANK / WORLD_SIZE, else (0, 1)."""
    if rank is not None and world_size is not None:
        found = (rank, world_size)
    elif dist.is_available() and dist.is_initialized():
        found = (dist.get_rank(), dist.get_world_size())
    else:
        found = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    r, w = (rank if rank is not None else found[0]), (world_size if world_size is not None else found[1])
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in [0, world_size={w})")
    return r, w


class SplitSource(IterableDataset):
    """A split of a shard set as one rank reads it: its manifest, the rank's place (:func:`resolve_rank_world`),
    the reader of its classes, each class's category and, for feature shards, the vectors' length.

    Attributes:
        feature_dim: the vectors' length for feature shards (``data.features``: batches are ``[n, dim]``
            float32, no transform), None for image shards.
    """

    def __init__(
        self,
        shards: str | os.PathLike[str] | Manifest,
        split: str,
        rank: int | None,
        world_size: int | None,
        cache_dir: str | os.PathLike[str] | ShardCache | None,
    ) -> None:
        super().__init__()
        self.manifest = shards if isinstance(shards, Manifest) else Manifest.load(shards)
        self.split = split
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.reader = ClassReader(self.manifest, split, cache_dir=cache_dir)
        self._class_category = np.array(
            [-1 if c.category is None else c.category for c in self.manifest.classes], dtype=np.int64
        )
        self.feature_dim = feature_dim(self.manifest)
