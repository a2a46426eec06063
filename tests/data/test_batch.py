"""The stream's typed batch: events add up, tensors move together, and a DataLoader (workers, pinning) hands the
batch on as a ``StreamBatch``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ddp_rank.data.reading.batch import DataEvents, StreamBatch


def _batch(step: int, events: DataEvents | None = None) -> StreamBatch:
    return StreamBatch(
        images=torch.full((2, 3, 4, 4), step, dtype=torch.uint8),
        labels=torch.tensor([step, step]),
        categories=torch.tensor([0, -1]),
        keys=[f"k{step}a", f"k{step}b"],
        epoch=1,
        step=step,
        groups=(0, -1),
        events=events or DataEvents(),
    )


class _Batches(IterableDataset[StreamBatch]):
    def __iter__(self) -> Iterator[StreamBatch]:
        return (_batch(k, DataEvents(replaced_classes=k)) for k in range(3))


def test_events_add_up() -> None:
    total = DataEvents()
    first = DataEvents(replaced_classes=1, decode_errors=1)
    first.note_bad_shard("train/b.tar")
    first.note_bad_shard("train/a.tar")
    first.note_bad_shard("train/b.tar")
    assert first.bad_shards == ["train/a.tar", "train/b.tar"]
    total.add(first).add(DataEvents(read_retries=2, bad_shards=["train/c.tar", "train/a.tar"]))
    total.add_counts({"cache_fallbacks": 3, "read_retries": 1})
    assert total.as_dict() == {
        "replaced_classes": 1,
        "decode_errors": 1,
        "cache_fallbacks": 3,
        "read_retries": 3,
        "bad_shards": ["train/a.tar", "train/b.tar", "train/c.tar"],
    }
    with pytest.raises(KeyError, match="'retries' is not a data event count"):
        total.add_counts({"retries": 1})


def test_to_moves_the_tensors_and_keeps_the_rest() -> None:
    batch = _batch(4, DataEvents(decode_errors=2))
    moved = batch.to(torch.device("cpu"), non_blocking=True)
    assert len(moved) == 2 and moved.keys == batch.keys and moved.events == batch.events
    assert (moved.epoch, moved.step, moved.groups) == (1, 4, (0, -1))
    assert all(torch.equal(a, b) for a, b in zip(moved.tensors(), batch.tensors()))
    on_meta = batch.to(torch.device("meta"))
    assert {t.device.type for t in on_meta.tensors()} == {"meta"} and batch.images.device.type == "cpu"


def test_a_dataloader_with_workers_hands_on_stream_batches() -> None:
    loader = DataLoader(_Batches(), batch_size=None, num_workers=1)
    got = list(loader)
    assert all(isinstance(b, StreamBatch) for b in got)
    assert [(b.step, b.events.replaced_classes, b.keys) for b in got] == [
        (k, k, [f"k{k}a", f"k{k}b"]) for k in range(3)
    ]


@pytest.mark.cuda
def test_a_pinning_dataloader_pins_the_batch_tensors() -> None:
    loader = DataLoader(_Batches(), batch_size=None, num_workers=1, pin_memory=True)
    got = list(loader)
    assert all(isinstance(b, StreamBatch) for b in got)
    assert all(t.is_pinned() for b in got for t in b.tensors())
