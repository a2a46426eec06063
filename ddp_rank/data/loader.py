"""A DataLoader around ``ShardStream`` that keeps the stream's position in the main process.

DataLoader workers iterate pickled copies of the dataset, so the main-process object never learns how far the
workers got. ``StreamLoader`` records the (epoch, step) of every batch it hands out; ``stream.state_dict()`` is
then the position to resume from, and the next ``iter`` starts there (the next epoch after a full one). Workers
are not persistent, because each epoch's workers must see the stream's position when they start.

A consumer that reads ahead (the trainer's ``DeviceFeed``) takes batches before it uses them: it passes
``track_position=False`` and reports each batch it hands on with :meth:`StreamLoader.consumed`.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DataLoader

from ddp_rank.data.batch import StreamBatch
from ddp_rank.data.stream import ShardStream


class StreamLoader:
    """Iterate one epoch (from the stream's position) per ``iter``; ``len`` is the steps left in that epoch."""

    def __init__(
        self,
        stream: ShardStream,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        track_position: bool = True,
    ) -> None:
        self.stream = stream
        self.pin_memory = pin_memory
        self.track_position = track_position
        self.prefetch_factor = prefetch_factor if stream.num_workers > 0 else None

    def __len__(self) -> int:
        _, step = self.stream.position
        return self.stream.steps_per_epoch - step

    def __iter__(self) -> Iterator[StreamBatch]:
        loader = DataLoader(
            self.stream,
            batch_size=None,
            num_workers=self.stream.num_workers,
            pin_memory=self.pin_memory,  # calls StreamBatch.pin_memory()
            prefetch_factor=self.prefetch_factor,
            persistent_workers=False,
        )
        for batch in loader:
            if self.track_position:
                self.consumed(batch)
            yield batch

    def consumed(self, batch: StreamBatch) -> None:
        """Record that ``batch`` was used: the next ``iter`` (and ``stream.state_dict()``) starts after it."""
        self.stream.advance(batch)
