"""Feature shards read once per run (``FeatureStream`` over a ``FeatureTable``): the same batches as the per-sample
path for the same plan, on any number of ranks, after a resume and with a corrupt shard; the shared file keyed by
the shards' digests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ddp_rank.data.features.synthetic import write_feature_shards
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.feature_stream import FeatureStream
from ddp_rank.data.reading.feature_table import table_key
from ddp_rank.data.reading.reader import ClassReader
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.sampling.schedule import ScheduleConfig


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_feature_shards(
        tmp_path_factory.mktemp("feat") / "f", classes_per_category=[5, 4, 6], images=5, dim=8, max_samples=12
    )


def assert_same_batch(a: object, b: object) -> None:
    for name in ("labels", "categories"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    np.testing.assert_array_equal(a.images.numpy(), b.images.numpy())  # type: ignore[attr-defined]
    assert a.images.dtype == b.images.dtype  # type: ignore[attr-defined]
    for name in ("keys", "epoch", "step", "groups", "events"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.mark.parametrize("strategy", ["hard", "random"])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mapped", [False, True])
def test_the_gathered_batches_are_the_per_sample_streams(
    shards: Path, tmp_path: Path, strategy: str, world_size: int, mapped: bool
) -> None:
    schedule = ScheduleConfig(strategy=strategy, seed=7)  # type: ignore[arg-type]
    for rank in range(world_size):
        common = {"schedule": schedule, "rank": rank, "world_size": world_size}
        old = ShardStream(shards, 12, **common)
        new = FeatureStream(
            shards, 12, **common, table_dir=tmp_path, memory_map_bytes=0 if mapped else 1 << 30
        )
        assert (new.table.path is not None) == mapped
        for epoch in (0, 3):
            for step in range(old.steps_per_epoch):
                assert_same_batch(new.batch(epoch, step), old.batch(epoch, step))


def test_a_resume_continues_the_same_batches_and_no_worker_runs(shards: Path) -> None:
    schedule = ScheduleConfig(strategy="hard", seed=1)
    old = ShardStream(shards, 12, schedule=schedule, rank=0, world_size=1)
    new = FeatureStream(shards, 12, schedule=schedule, rank=0, world_size=1, num_workers=2)
    assert new.num_workers == 0  # the gather runs in the trainer's process: no loader process for the cores
    new.load_state_dict({"epoch": 2, "step": 1})
    old.load_state_dict({"epoch": 2, "step": 1})
    for a, b in zip(new, old, strict=True):
        assert_same_batch(a, b)


def test_a_class_that_does_not_read_is_replaced_as_before(shards: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in shards.rglob("*"):
        target = broken / path.relative_to(shards)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.write_bytes(path.read_bytes())
    manifest = Manifest.load(broken)
    shard = manifest.split("train").shards[0]
    tar = manifest.shard_path(shard)
    data = bytearray(tar.read_bytes())
    span = shard.classes[0]
    data[span.offset + span.length - 600] ^= 0xFF  # inside the class's last vector: its digest fails
    tar.write_bytes(bytes(data))
    schedule = ScheduleConfig(strategy="random", seed=5)
    old = ShardStream(broken, 12, schedule=schedule, rank=0, world_size=1)
    new = FeatureStream(broken, 12, schedule=schedule, rank=0, world_size=1, table_dir=tmp_path / "t")
    assert span.id in new.table.failures
    replaced = 0
    for epoch in range(3):
        for step in range(old.steps_per_epoch):
            a, b = new.batch(epoch, step), old.batch(epoch, step)
            assert_same_batch(a, b)
            replaced += a.events.replaced_classes
    assert replaced > 0  # the broken class was asked for, and replaced alike
    assert not list((tmp_path / "t").glob("*.f16"))  # a table with failures is never shared


def test_a_row_that_does_not_decode_fails_its_class_only_when_taken(shards: Path) -> None:
    schedule = ScheduleConfig(strategy="random", seed=5)
    old = ShardStream(shards, 12, schedule=schedule, rank=0, world_size=1)
    new = FeatureStream(shards, 12, schedule=schedule, rank=0, world_size=1)
    piece = new.part(0, 0)[0]
    row = int(new.table.starts[piece.class_id]) + int(piece.images[0])
    new.table.bad_rows[row] = "the vector holds a non-finite value"
    new._bad_rows = np.array([row])
    batch = new.batch(0, 0)
    assert batch.events.decode_errors == 1 and batch.events.replaced_classes == 1
    assert piece.class_id not in batch.labels.tolist()
    assert len(batch) == len(old.batch(0, 0))  # a class of the reserve took its place


def test_the_shared_file_is_read_again_and_keyed_by_the_shards(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = FeatureStream(shards, 12, rank=0, world_size=1, table_dir=tmp_path, memory_map_bytes=0)
    manifest = Manifest.load(shards)
    key = table_key(manifest, "train", 8)
    assert first.table.path == tmp_path / f"features-{key}.f16"
    assert json.loads((tmp_path / f"features-{key}.json").read_text())["rows"] == len(first.table.keys)

    def no_read(self: ClassReader, class_id: int) -> None:
        raise AssertionError("the shards were read again")

    monkeypatch.setattr(ClassReader, "read", no_read)
    again = FeatureStream(shards, 12, rank=0, world_size=1, table_dir=tmp_path, memory_map_bytes=0)
    assert again.table.path == first.table.path
    np.testing.assert_array_equal(again.batch(0, 1).images.numpy(), first.batch(0, 1).images.numpy())

    other = write_feature_shards(tmp_path / "g", classes_per_category=[5, 4, 6], images=5, dim=8, seed=1)
    assert table_key(Manifest.load(other), "train", 8) != key  # other vectors, another file: never stale
    assert table_key(manifest, "test", 8) != key
