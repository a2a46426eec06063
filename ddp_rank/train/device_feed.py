"""Keep the device fed: the next batch is read and copied to the device while the current step computes.

The DataLoader's workers already prepare batches ahead on the host; what remains is the copy to the GPU and, with
no workers, the read itself. :class:`DeviceFeed` holds one batch in hand: when the trainer takes batch ``k`` it
has already asked the loader for batch ``k + 1`` and, on CUDA, started that batch's copy on a side stream, which
overlaps the step on the default stream (the host tensors are pinned by the loader, so the copy is asynchronous).

Two things a look-ahead must not change:

- **Errors belong to their batch.** An exception raised while fetching batch ``k + 1`` is kept and raised when the
  trainer asks for ``k + 1``, so the trainer's per-step agreement between ranks (``Trainer._next_batch``) still
  sees it at the step it concerns, on the same call as every other rank.
- **Positions are those consumed.** The loader's notion of "handed out" runs one batch ahead; the feed reports
  each batch when it hands it on (``consumed``, with ``StreamLoader(track_position=False)``: the loader's
  ``consumed``), so a checkpoint resumes at the first batch not trained on.

On the CPU the feed does the same look-ahead with no copy, so the CPU tests run the code path a GPU run takes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from ddp_rank.data.batch import StreamBatch

__all__ = ["DeviceFeed"]


class DeviceFeed:
    """Iterate ``batches`` with their tensors moved to ``device``, one batch read (and copied) ahead.

    The batch's tensors are moved (``StreamBatch.to``); everything else (keys, step, events) passes through.
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
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead: StreamBatch | BaseException | None = None
        self._done = False
        self._read_ahead()

    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> StreamBatch:
        ahead = self._ahead
        if self._done and ahead is None:
            raise StopIteration
        self._ahead = None
        if isinstance(ahead, BaseException):
            self._done = True  # a failed loader is not read again
            raise ahead
        assert ahead is not None
        if self._copy_stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._copy_stream)
            for value in ahead.tensors():
                if value.device.type == "cuda":
                    # The allocator must not reuse this memory for the side stream while the step still reads it.
                    value.record_stream(current)
        if self._consumed is not None:
            self._consumed(ahead)
        self._read_ahead()
        return ahead

    def close(self) -> None:
        """Drop the batch in hand and the loader (its workers end with it)."""
        self._ahead, self._done = None, True
        self._source = iter(())

    def _read_ahead(self) -> None:
        if self._done:
            return
        try:
            host = next(self._source)
        except StopIteration:
            self._done = True
            return
        except Exception as exc:  # re-raised, unchanged, when its batch is asked for
            self._ahead = exc
            return
        self._ahead = self._to_device(host)

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
