"""The trainer's batches: this rank's local batch of each step, read ahead onto the device, agreed on by every
rank (a data failure or a stop request on one rank is seen by all at the same step), with the data layer's
events counted for the logs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ddp_rank.data.reading.batch import DataEvents, StreamBatch
from ddp_rank.data.reading.feature_stream import FeatureStream
from ddp_rank.data.reading.loader import StreamLoader
from ddp_rank.data.reading.stream import DataError, ShardStream
from ddp_rank.distributed.agreement import RankFailure, agree, gather_counts
from ddp_rank.runtime import TrainError
from ddp_rank.train.device_feed import DeviceFeed, InlineFeed

__all__ = ["TrainBatches"]


class TrainBatches:
    """``next()`` gives the next local batch on ``device``; the stream's position follows the batches handed out,
    so ``stream.state_dict()`` is always the first batch not trained on."""

    def __init__(
        self, stream: ShardStream, device: torch.device, stop_requested: Callable[[], bool] = lambda: False
    ) -> None:
        self.stream = stream
        self.device = device
        self.stop_requested = stop_requested
        self.stop_agreed = False  # some rank asked to stop: every rank stops after the step of this batch
        # Pinned host batches: their copy to the GPU is asynchronous (DeviceFeed overlaps it with the step).
        self.loader = StreamLoader(stream, pin_memory=device.type == "cuda", track_position=False)
        self.events = DataEvents()  # this rank's, summed over the batches handed out
        self._feed: DeviceFeed | InlineFeed | None = None

    def next(self) -> StreamBatch:
        """The next local batch, agreed on by every rank: if any rank's data layer fails (no readable
        replacement left), every rank raises that rank's message instead of waiting in the next collective."""
        error: str | None = None
        batch: StreamBatch | None = None
        try:
            batch = self._fetch()
        except DataError as exc:
            error = str(exc)
        try:
            self.stop_agreed = agree(error, stop=self.stop_requested()) or self.stop_agreed
        except RankFailure as exc:
            raise TrainError(f"data: {exc}") from None
        assert batch is not None  # a fetch that failed raised above, on every rank
        self.events.add(batch.events)
        return batch

    def counts(self) -> dict[str, Any]:
        """The data events of every rank so far (a collective: call it on every rank)."""
        return gather_counts(self.events.as_dict())

    def restart(self) -> None:
        """Forget the batch read ahead (after the stream was moved, e.g. by a resume)."""
        if self._feed is not None:
            self._feed.close()
            self._feed = None

    close = restart

    def _fetch(self) -> StreamBatch:
        # None at the end of an epoch: the loader's next iter starts the next one.
        batch = next(self._feed, None) if self._feed is not None else None
        if batch is None:
            # A new DataLoader iterator draws its worker base seed from the global RNG; fork it so that a resumed
            # run (which starts a new iterator mid-epoch) keeps the model's RNG stream identical to an
            # uninterrupted one. The stream seeds each image's augmentation from (seed, epoch, step, class, image).
            with torch.random.fork_rng(devices=[]):
                if isinstance(self.stream, FeatureStream):  # one gather from memory: inline, no DataLoader
                    self._feed = InlineFeed(iter(self.stream), self.device, consumed=self.loader.consumed)
                else:
                    self._feed = DeviceFeed(iter(self.loader), self.device, consumed=self.loader.consumed)
                batch = next(self._feed)
        return batch
