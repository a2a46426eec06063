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

    def state_dict(self) -> dict[str, Any]:
        """The first batch not trained on (the stream's position) and what decides which samples each step draws
        (:meth:`schedule`): a checkpoint's ``stream`` record."""
        return {**self.stream.state_dict(), **self.schedule()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue after the batches trained on, on any world size and worker count (the plan depends on
        neither); the batch read ahead is dropped. The saved position counts in the saved epochs' length, so a
        forced resume with another ``data.steps_per_epoch`` continues after as many steps. Whether the saved
        schedule may be continued is :meth:`schedule_changes`' to say."""
        length = int(state.get("steps_per_epoch", self.stream.steps_per_epoch))
        trained = int(state["epoch"]) * length + int(state["step"])
        self.stream.set_position(*divmod(trained, self.stream.steps_per_epoch))
        self.close()

    def schedule(self) -> dict[str, Any]:
        """The data schedule: the sampler's settings (``data.sampler=auto`` resolved) and the epoch's length."""
        s = self.stream.schedule_config
        return {
            "seed": s.seed,
            "sampler": s.strategy,
            "categories_per_batch": s.categories_per_batch,
            "batches_per_pair": s.batches_per_pair,
            "images_per_class": s.images_per_class,
            "category_aware": s.category_aware,
            "steps_per_epoch": self.stream.steps_per_epoch,
        }

    def schedule_changes(self, saved: dict[str, Any]) -> str:
        """The settings of :meth:`schedule` that differ from the ``saved`` record, as ``key: saved -> now``
        (empty when none does: the resumed run sees the batches of the one it continues)."""
        return ", ".join(
            f"{k}: {saved[k]} -> {v}" for k, v in self.schedule().items() if k in saved and saved[k] != v
        )

    def close(self) -> None:
        """Forget the batch read ahead (safe to call twice)."""
        if self._feed is not None:
            self._feed.close()
            self._feed = None

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
