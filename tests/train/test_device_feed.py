"""The throughput path on any machine: uint8 batches converted by the model, the look-ahead feed, channels-last.

References: the data layer's float path (the uint8 path must give the same float32 pixels, hence the same
embeddings, bit for bit), and plain iteration for the feed (same batches, same order, errors at their own batch).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from ddp_rank.config import ModelConfig
from ddp_rank.data.reading.batch import StreamBatch
from ddp_rank.data.reading.transforms import TransformConfig, collate_images, normalize_batch, uint8_to_unit
from ddp_rank.model.net import RawPixels, build_model, is_convolutional
from ddp_rank.train.device_feed import DeviceFeed


def pixels(n: int = 6, side: int = 16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, side, side), generator=g, dtype=torch.uint8) for _ in range(n)]


def test_uint8_batches_convert_to_the_float_path_bit_for_bit() -> None:
    images = pixels()
    unit = TransformConfig(resize=16, crop=16, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0))
    as_bytes = collate_images(images, TransformConfig(resize=16, crop=16, pixels="uint8"))
    assert as_bytes.dtype == torch.uint8 and as_bytes.shape == (6, 3, 16, 16)
    assert torch.equal(uint8_to_unit(as_bytes), normalize_batch(images, unit))
    assert torch.equal(collate_images(images, unit), normalize_batch(images, unit))
    with pytest.raises(ValueError, match="pixels 'int8': valid are float, uint8"):
        TransformConfig(pixels="int8")


@pytest.mark.parametrize("backbone", ["tiny_cnn", "resnet18"])
def test_the_model_takes_uint8_and_gives_the_float_embeddings(backbone: str) -> None:
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone=backbone, weights="none", embedding_dim=8), 16).eval()
    images = torch.stack(pixels())
    unit = normalize_batch(list(images), TransformConfig(resize=16, crop=16, mean=(0,) * 3, std=(1,) * 3))
    with torch.no_grad():
        assert torch.equal(model(images), model(unit))
        reference = model(unit)
        # Channels-last changes the convolutions' summation order only: the same embeddings to rounding, and
        # still the same for uint8 and float inputs.
        model.use_channels_last()
        convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
        assert all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
        assert torch.equal(model(images), model(unit))
        torch.testing.assert_close(model(images), reference, rtol=1e-5, atol=1e-5)
    assert is_convolutional(model)


def test_uint8_into_a_module_cast_to_bfloat16() -> None:
    """DeepSpeed bf16 casts the module and runs no autocast: the scaled pixels must reach the backbone in bf16."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(backbone="tiny_cnn", embedding_dim=8), 16).eval()
    reference = model(torch.stack(pixels()))
    model.to(torch.bfloat16)
    got = model(torch.stack(pixels()))
    assert got.dtype == torch.float32  # L2 normalisation runs in float32
    torch.testing.assert_close(got, reference, rtol=0, atol=5e-2)


def test_raw_pixels_take_uint8() -> None:
    images = torch.stack(pixels(side=32))
    torch.testing.assert_close(RawPixels(8)(images), RawPixels(8)(uint8_to_unit(images)), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- the feed


def batches(n: int, fail_at: int | None = None, log: list[int] | None = None) -> Iterator[StreamBatch]:
    for k in range(n):
        if log is not None:
            log.append(k)
        if k == fail_at:
            raise OSError(f"batch {k} unreadable")
        images = torch.full((2, 3, 4, 4), k, dtype=torch.uint8)
        labels = torch.tensor([k, k])
        yield StreamBatch(images, labels, torch.zeros(2, dtype=torch.int64), ["a", "b"], 0, k, (0,))


def test_the_feed_yields_every_batch_in_order() -> None:
    feed = DeviceFeed(batches(4), torch.device("cpu"))
    got = list(feed)
    assert [b.step for b in got] == [0, 1, 2, 3]
    assert all(torch.equal(b.images, torch.full((2, 3, 4, 4), b.step, dtype=torch.uint8)) for b in got)
    with pytest.raises(StopIteration):
        next(feed)


def test_the_next_batch_is_read_while_the_step_runs_and_no_further() -> None:
    """The overlap itself: reading batch k + 1 can only finish once step k has started (the source waits for
    it), and step k waits for that read: a feed that reads k + 1 before handing k over (or not at all while the
    step runs) fails here instead of hanging. The reader never runs two batches ahead."""
    stepping = [threading.Event() for _ in range(4)]
    read = [threading.Event() for _ in range(4)]
    started: list[int] = []

    def source() -> Iterator[StreamBatch]:
        for k, batch in enumerate(batches(4)):
            started.append(k)
            if k > 0:
                assert stepping[k - 1].wait(10), f"batch {k} was read before step {k - 1} started"
            read[k].set()
            yield batch

    feed = DeviceFeed(source(), torch.device("cpu"))
    for k in range(3):
        batch = next(feed)
        assert batch.step == k
        stepping[k].set()  # the step runs ...
        assert read[k + 1].wait(10), f"batch {k + 1} was not read while step {k} ran"
        time.sleep(0.2)
        assert started == list(range(k + 2)), "the reader went two batches ahead"
    feed.close()


def test_closing_waits_for_the_read_in_progress() -> None:
    """After ``close`` nothing reads the source any more (a new feed may read the same stream)."""
    reading, release = threading.Event(), threading.Event()
    finished: list[int] = []

    def source() -> Iterator[StreamBatch]:
        for k, batch in enumerate(batches(3)):
            if k == 1:
                reading.set()
                release.wait(10)
                time.sleep(0.2)
                finished.append(k)
            yield batch

    feed = DeviceFeed(source(), torch.device("cpu"))
    next(feed)
    assert reading.wait(10)
    release.set()
    feed.close()
    assert finished == [1]
    with pytest.raises(StopIteration):
        next(feed)


def test_an_error_is_raised_at_the_batch_it_belongs_to() -> None:
    feed = DeviceFeed(batches(5, fail_at=2), torch.device("cpu"))
    assert [next(feed).step, next(feed).step] == [0, 1]  # batch 2 already failed, but 0 and 1 are whole
    with pytest.raises(OSError, match="batch 2 unreadable"):
        next(feed)
    with pytest.raises(StopIteration):  # a failed loader is not read again
        next(feed)


def test_closing_the_feed_drops_the_batch_in_hand() -> None:
    feed = DeviceFeed(batches(3), torch.device("cpu"))
    feed.close()
    with pytest.raises(StopIteration):
        next(feed)


@pytest.mark.cuda
def test_the_feed_copies_to_cuda_on_a_side_stream() -> None:
    device = torch.device("cuda")
    host = [b.pin_memory() for b in batches(4)]
    feed = DeviceFeed(iter(host), device)
    for k, batch in enumerate(feed):
        assert batch.images.device.type == "cuda" and batch.step == k
        # Work on the default stream right after the hand-over sees the copied values.
        assert int(batch.images.float().sum()) == k * 2 * 3 * 4 * 4


def test_the_step_waits_for_its_own_batchs_copy_not_the_next_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the step's stream waits for the side stream's copies when a batch is handed over; the reader may
    start the next batch (and queue its copy on that side stream) only after that wait, or every step would also
    wait for the next batch's copy. Fake streams on the CPU record how many batches had been fetched at each
    wait; the wait leaves a reader released too early the time to fetch one more."""
    fetched: list[int] = []
    at_wait: list[int] = []

    class FakeStream:
        def __init__(self, *args: object) -> None:
            pass

        def wait_stream(self, other: object) -> None:
            time.sleep(0.2)
            at_wait.append(len(fetched))

    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(StreamBatch, "to", lambda self, device, non_blocking=False: self)

    def source() -> Iterator[StreamBatch]:
        for batch in batches(3):
            fetched.append(batch.step)
            yield batch

    assert [b.step for b in DeviceFeed(source(), torch.device("cuda"))] == [0, 1, 2]
    assert at_wait == [1, 2, 3]
