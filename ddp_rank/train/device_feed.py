"""Keep the device fed: the next batch is read and copied to the device while the current step computes.

:class:`DeviceFeed` reads in a thread of its own. When the trainer takes batch ``k``, the reader starts on batch
``k + 1``: it asks the loader for it (the DataLoader's workers, or with ``num_workers=0`` the stream itself, read
and decode it) and, on CUDA, copies it to the device on a side stream. All of that runs while step ``k``
computes; the trainer waits only when batch ``k + 1`` is not ready by the time it asks, and that wait is what its
``data_time`` measures. At most one batch is held ahead of the one in use (device memory for two batches, as
with a plain double buffer).

Three things the reader must not change:

- **Errors belong to their batch.** An exception raised while fetching batch ``k + 1`` is kept and raised when the
  trainer asks for ``k + 1``, so the trainer's per-step agreement between ranks (``TrainBatches.next``) still
  sees it at the step it concerns, on the same call as every other rank.
- **Positions are those consumed.** The loader's notion of "handed out" runs one batch ahead; the feed reports
  each batch when it hands it on (``consumed``, with ``StreamLoader(track_position=False)``: the loader's
  ``consumed``), so a checkpoint resumes at the first batch not trained on.
- **The model's random stream.** The stream draws each image's augmentation from a generator of its own (never
  the torch RNG that dropout and the chunked step's replay use), so reading in another thread moves no random
  number the step draws.

On the CPU the feed reads ahead the same way with no copy, so the CPU tests run the code path a GPU run takes, and
a CPU run overlaps its reads (decoding and file reads release the GIL) with its step too.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from ddp_rank.data.reading.batch import StreamBatch

if TYPE_CHECKING:  # typing.Self from Python 3.11
    from typing_extensions import Self

__all__ = ["DeviceFeed", "InlineFeed"]

_END = object()
"""Put by the reader when the loader is exhausted."""


class InlineFeed:
    """:class:`DeviceFeed`'s interface without its thread: each batch is read when it is asked for, in the
    caller's thread, then moved to ``device``.

    For a stream whose batch is one gather from memory (``FeatureStream``): reading it costs less than handing
    it over from a thread (a wake-up, the GIL passed back and forth), and no thread competes with the step for
    the cores. Errors are raised at their own batch, and ``consumed`` reports each batch as it is handed on, as
    with the threaded feed.
    """

    def __init__(
        self,
        batches: Iterator[StreamBatch],
        device: torch.device,
        consumed: Callable[[StreamBatch], None] | None = None,
    ) -> None:
        self._source = batches
        self.device = device
        self._consumed = consumed
        self._start()

    def __iter__(self) -> Self:
        return self

    def _start(self) -> None:
        """What the feed sets up once it has its source: nothing here; :class:`DeviceFeed`'s reader thread."""

    def __next__(self) -> StreamBatch:
        batch = next(self._source)
        return self._handed_on(batch if self.device.type == "cpu" else batch.to(self.device))

    def close(self) -> None:
        """Nothing is read ahead: only the source is dropped."""
        self._source = iter(())

    def _handed_on(self, batch: StreamBatch) -> StreamBatch:
        """``batch``, reported as consumed: the position a checkpoint resumes from is past it."""
        if self._consumed is not None:
            self._consumed(batch)
        return batch


class DeviceFeed(InlineFeed):
    """Iterate ``batches`` with their tensors moved to ``device``, the next batch read (and copied) by a background
    thread while the caller works on the current one.

    The batch's tensors are moved (``StreamBatch.to``); everything else (keys, step, events) passes through.
    :meth:`close` stops the reader after the fetch in progress, and waits for it: once it returns, nothing reads
    from ``batches`` any more (a new feed may read the same stream).
    """

    def _start(self) -> None:
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._ready: queue.Queue[object] = queue.Queue()
        self._may_read = threading.Semaphore(1)  # the reader fetches one batch per batch handed over
        self._closed = threading.Event()
        self._done = False
        self._reader = threading.Thread(target=self._read, name="ddp_rank-device-feed", daemon=True)
        self._reader.start()

    def __next__(self) -> StreamBatch:
        if self._done:
            raise StopIteration
        item = self._ready.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True  # a failed loader is not read again
            raise item
        assert isinstance(item, StreamBatch)
        if self._copy_stream is not None:
            # Before the reader may start the next batch: the side stream then holds this batch's copy and no
            # later one, so the step waits for its own batch only, not for the copy of the next.
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._copy_stream)
            for value in item.tensors():
                if value.device.type == "cuda":
                    # The allocator must not reuse this memory for the side stream while the step still reads it.
                    value.record_stream(current)
        self._may_read.release()  # the reader starts on the next batch while the caller works on this one
        return self._handed_on(item)

    def close(self) -> None:
        """Stop the reader (after the fetch it is in, if any) and drop the batch read ahead."""
        self._done = True
        self._closed.set()
        self._reader.join()
        self._ready = queue.Queue()
        self._source = iter(())

    def _read(self) -> None:
        """The reader thread: wait for a free place, fetch and copy one batch, hand it over; until the loader
        ends, fails, or the feed is closed."""
        while self._wait_for_a_place():
            try:
                item: object = self._to_device(next(self._source))
            except StopIteration:
                item = _END
            except Exception as exc:  # re-raised, unchanged, when its batch is asked for
                item = exc
            if self._closed.is_set():
                return
            self._ready.put(item)
            if not isinstance(item, StreamBatch):
                return

    def _wait_for_a_place(self) -> bool:
        while not self._closed.is_set():
            if self._may_read.acquire(timeout=0.1):
                return not self._closed.is_set()
        return False

    def _to_device(self, host: StreamBatch) -> StreamBatch:
        if self.device.type == "cpu":
            return host
        on_side = (
            torch.cuda.stream(self._copy_stream)
            if self._copy_stream is not None
            else contextlib.nullcontext()
        )
        with on_side:
            return host.to(self.device, non_blocking=True)
