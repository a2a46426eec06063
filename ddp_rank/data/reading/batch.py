"""The training stream's batch (``StreamBatch``) and the data events it carries (``DataEvents``).

A batch crosses process boundaries (DataLoader workers pickle it), gets pinned (a DataLoader with
``pin_memory=True`` calls ``pin_memory()`` on any object that has one) and is copied to the device
(``to(device, non_blocking=True)``); only its three tensors move, the rest rides along.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["DataEvents", "StreamBatch"]


@dataclass
class DataEvents:
    """What went wrong while reading, counted: per batch (the stream's) or summed over a run (the trainer's)."""

    replaced_classes: int = 0
    """Classes this rank could not read or decode, replaced from the step's reserve."""
    decode_errors: int = 0
    """Images that did not decode (each one makes its class replaced)."""
    cache_fallbacks: int = 0
    """Shards read by ranged reads because the local cache could not hold them."""
    read_retries: int = 0
    """Remote reads retried after a transient failure."""
    bad_shards: list[str] = field(default_factory=list)
    """Shards (paths in the manifest) a class could not be read from, sorted, each once."""

    def note_bad_shard(self, shard: str) -> None:
        if shard not in self.bad_shards:
            self.bad_shards.append(shard)
            self.bad_shards.sort()

    def add(self, other: DataEvents) -> DataEvents:
        """Add ``other``'s counts and bad shards to these (in place); returns self."""
        self.replaced_classes += other.replaced_classes
        self.decode_errors += other.decode_errors
        self.cache_fallbacks += other.cache_fallbacks
        self.read_retries += other.read_retries
        self.bad_shards = sorted(set(self.bad_shards) | set(other.bad_shards))
        return self

    def add_counts(self, counts: Mapping[str, int]) -> DataEvents:
        """Add counts named like the fields (the store's ``take_counts()``); an unknown name is an error."""
        for name, value in counts.items():
            if name == "bad_shards" or name not in _COUNTS:
                raise KeyError(f"{name!r} is not a data event count (expected one of {', '.join(_COUNTS)})")
            setattr(self, name, getattr(self, name) + int(value))
        return self

    def as_dict(self) -> dict[str, Any]:
        """Plain values, for the logs and for gathering over ranks."""
        return dataclasses.asdict(self)


_COUNTS = tuple(f.name for f in dataclasses.fields(DataEvents) if f.name != "bad_shards")


@dataclass
class StreamBatch:
    """One rank's local batch of one step (``stream.ShardStream``)."""

    images: Tensor
    """[n, 3, H, W], float32 or uint8 as ``TransformConfig.pixels`` says."""
    labels: Tensor
    """int64 [n], global class ids."""
    categories: Tensor
    """int64 [n], category ids; -1 for an unlabelled class."""
    keys: list[str]
    """Sample keys, one per image."""
    epoch: int
    step: int
    groups: tuple[int, ...]
    """The schedule's groups of this step (categories, or the schedule's ALL / UNLABELLED)."""
    events: DataEvents = field(default_factory=DataEvents)

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.images, self.labels, self.categories

    def to(self, device: torch.device | str, non_blocking: bool = False) -> StreamBatch:
        """The batch with its tensors on ``device`` (asynchronous from pinned memory with ``non_blocking``)."""
        return self._with(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> StreamBatch:
        """The batch with its tensors in page-locked memory (what a DataLoader's ``pin_memory=True`` calls)."""
        return self._with(lambda t: t.pin_memory())

    def _with(self, move: Any) -> StreamBatch:
        return dataclasses.replace(
            self, images=move(self.images), labels=move(self.labels), categories=move(self.categories)
        )
