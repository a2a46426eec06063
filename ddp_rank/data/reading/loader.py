"""A DataLoader around ``ShardStream`` that keeps the stream's position in the main process.

DataLoader workers iterate pickled copies of the dataset, so the main-process object never learns how far the
workers got. ``StreamLoader`` records the (epoch, step) of every batch it hands out; ``stream.state_dict()`` is
then the position to resume from, and the next ``iter`` starts there (the next epoch after a full one). Workers
are not persistent, because each epoch's workers must see the stream's position when they start.

A consumer that reads ahead (the trainer's ``DeviceFeed``) takes batches before it uses them: it passes
``track_position=False`` and reports each batch it hands on with :meth:`StreamLoader.consumed`.

Every DataLoader of the data and evaluation layers starts its workers with :func:`ignore_stop_signals`: a
scheduler signals every process of a job (SLURM) and a launcher signals each rank's whole process group
(torchrun), so the workers receive the signal that asks the main process to stop (see that function).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

from torch.utils.data import DataLoader

from ddp_rank.data.reading.batch import StreamBatch
from ddp_rank.data.reading.stream import ShardStream

STOP_SIGNALS = ("SIGHUP", "SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")
"""The signals a job may be asked to stop with (a scheduler's preemption or time-limit warning, a terminal):
the DataLoader workers ignore them all, whichever the main process acts on."""


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn``: this DataLoader worker ignores :data:`STOP_SIGNALS`; what to do is its main process's
    decision.

    Why: torch's workers die of a SIGTERM that does not come from their parent (their C handler, installed before
    this runs), and a forked worker inherits the main process's Python handlers (each would log the request and
    arm a grace timer of its own); either way the main process sees a worker vanish and raises "DataLoader worker
    ... exited unexpectedly" instead of stopping with a checkpoint. A worker still ends when its main process
    ends it (at the end of the batch in hand) or dies (torch's watchdog notices within seconds).
    """
    for name in STOP_SIGNALS:
        signal.signal(signal.Signals[name], signal.SIG_IGN)


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
            worker_init_fn=ignore_stop_signals,
        )
        for batch in loader:
            if self.track_position:
                self.consumed(batch)
            yield batch

    def consumed(self, batch: StreamBatch) -> None:
        """Record that ``batch`` was used: the next ``iter`` (and ``stream.state_dict()``) starts after it."""
        self.stream.advance(batch)
