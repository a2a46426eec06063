"""The training stream of a feature split, gathered by row index from vectors read once (``feature_table``).

``FeatureStream`` is a ``ShardStream`` whose batches come from a ``FeatureTable`` instead of a read and a tar walk
per class per step: this rank's part of step ``s`` (the same ``part(epoch, step)``, a pure function of seed,
epoch, step and manifest) becomes one index array and one gather, with no Python work per sample. The batch
holds the rows, labels, categories and keys today's per-sample path gives for the same plan, in the same order,
so a resume, a run on any number of ranks and the loss values are unchanged.

A step whose part holds a class the table could not read, or a row that does not decode, is built by the
per-sample path (``ShardStream.batch``) over the table: the class is replaced from the plan's reserve and counted
exactly as there. No DataLoader worker is used: the gather costs less than handing a batch between processes,
and a worker would compete with the step for the cores.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ddp_rank.data.reading.batch import DataEvents, StreamBatch
from ddp_rank.data.reading.feature_table import MEMORY_MAP_BYTES, FeatureTable, load_feature_table
from ddp_rank.data.reading.reader import ClassReadError
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.sampling.plan import Piece

__all__ = ["FeatureStream"]


class FeatureStream(ShardStream):
    """``ShardStream`` over a feature split, read once. ``table_dir``: where a split above ``memory_map_bytes``
    is written once and memory-mapped (the node-local cache folder, or a folder beside the run); None holds
    every split in memory. The other arguments are ``ShardStream``'s; ``num_workers`` is ignored (always 0)."""

    def __init__(
        self,
        *args: Any,
        table_dir: str | os.PathLike[str] | None = None,
        memory_map_bytes: int = MEMORY_MAP_BYTES,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.feature_dim is None:
            raise ValueError(
                f"{self.manifest.root} holds images, not feature vectors: read it with ShardStream"
            )
        self.num_workers = 0
        self.table: FeatureTable = load_feature_table(
            self.reader, self.manifest, self.split, self.feature_dim, table_dir, memory_map_bytes
        )
        self.reader.close()  # every read is done: the shards' files need not stay open
        self._bad_rows = np.array(sorted(self.table.bad_rows), dtype=np.int64)

    def batch(self, epoch: int, step: int) -> StreamBatch:
        """This rank's part of (epoch, step), gathered from the table."""
        pieces = self.part(epoch, step)
        class_ids = np.fromiter((p.class_id for p in pieces), dtype=np.int64, count=len(pieces))
        sizes = np.fromiter((len(p.images) for p in pieces), dtype=np.int64, count=len(pieces))
        starts = self.table.starts[class_ids]
        offsets = np.concatenate([np.asarray(p.images, dtype=np.int64) for p in pieces]) if pieces else None
        rows = np.repeat(starts, sizes) + (offsets if offsets is not None else 0)
        if (starts < 0).any() or (self._bad_rows.size and np.isin(rows, self._bad_rows).any()):
            return super().batch(epoch, step)  # a class to replace: the per-sample path, over the table
        events = DataEvents().add_counts(self.reader.store.take_counts())
        labels = torch.from_numpy(np.repeat(class_ids, sizes))
        return StreamBatch(
            images=torch.from_numpy(self.table.vectors[rows]).to(
                torch.float32
            ),  # a copy, or float16's widening
            labels=labels,
            categories=torch.from_numpy(self._class_category[labels.numpy()]),
            keys=self.table.keys[rows].tolist(),
            epoch=epoch,
            step=step,
            groups=self.plan.step(epoch, step).groups,
            events=events,
        )

    def _load(
        self, epoch: int, step: int, piece: Piece, transform: Any, events: DataEvents
    ) -> tuple[list[str], list[torch.Tensor]]:
        """One class of a step the fast path left to ``ShardStream.batch``: from the table, failing where the
        per-sample path would (the class's read error, or the first chosen row that does not decode)."""
        class_id = piece.class_id
        if class_id in self.table.failures:
            # A new error each time: the stored one, raised again, would carry every earlier raise's traceback
            # (and the frames it holds) for as long as the run draws that class.
            failure = self.table.failures[class_id]
            raise ClassReadError(failure.class_id, failure.shard, failure.reason)
        first = int(self.table.starts[class_id])
        keys, out = [], []
        for index in piece.images:
            row = first + int(index)
            key = str(self.table.keys[row])
            if row in self.table.bad_rows:
                events.decode_errors += 1
                shard = self.reader.shard_of(class_id, int(index))
                reason = f"vector {key} does not decode: {self.table.bad_rows[row]}"
                raise ClassReadError(class_id, shard, reason)
            keys.append(key)
            out.append(torch.from_numpy(self.table.vectors[row].astype(np.float32)))
        return keys, out
