"""The training stream on tiny shards written by the build code: one global plan, any layout.

Ranks and DataLoader workers are simulated in one process: each rank is a ShardStream built with that rank /
world size, its workers played through ``iter_worker`` and interleaved round-robin, which is what a DataLoader
with ``batch_size=None`` does (one test checks that on a real one).
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from collections import Counter
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.loader import StreamLoader
from ddp_rank.data.reading.stream import DataError, ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4 ranks
TINY = TransformConfig(resize=8, crop=6)
# 4 categories x 17 classes of 2..5 images (59 images each).
CLASS_SIZES = [[2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 3]] * 4
SCHEDULE = ScheduleConfig(batches_per_pair=1, seed=7)


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    write_image_folder(root / "images", CLASS_SIZES, image_size=8)
    out = root / "shards"
    build_shards(read_image_folder(root / "images"), out, BuildOptions(max_samples=12, progress=False))
    return out


def make(shards: Path | str, rank: int, world: int, workers: int = 0, **kwargs: Any) -> ShardStream:
    return ShardStream(
        shards,
        kwargs.pop("global_batch", GLOBAL_BATCH),
        rank=rank,
        world_size=world,
        num_workers=workers,
        schedule=kwargs.pop("schedule", SCHEDULE),
        transform=TINY,
        **kwargs,
    )


def round_robin(iterators: list[Iterator[dict[str, Any]]]) -> list[dict[str, Any]]:
    """What DataLoader(batch_size=None) yields from its workers: one item from each in turn."""
    out = []
    for items in zip_longest(*iterators):
        out.extend(b for b in items if b is not None)
    return out


def play_rank(stream: ShardStream) -> list[dict[str, Any]]:
    workers = max(1, stream.num_workers)
    return round_robin([stream.iter_worker(w, workers) for w in range(workers)])


def play(shards: Path | str, world: int, workers: int = 0, **kwargs: Any) -> list[list[dict[str, Any]]]:
    return [play_rank(make(shards, r, world, workers, **kwargs)) for r in range(world)]


def global_batches(ranks: list[list[dict[str, Any]]]) -> list[dict[str, torch.Tensor]]:
    """Per step: key -> image over all ranks."""
    return [{k: img for b in step for k, img in zip(b.keys, b.images)} for step in zip(*ranks)]


@pytest.fixture(scope="module")
def reference(shards: Path) -> list[dict[str, torch.Tensor]]:
    return global_batches(play(shards, 1, 0))


@pytest.mark.parametrize(("world", "workers"), [(w, n) for w in (1, 2, 3, 4) for n in (0, 1, 3)])
def test_every_layout_trains_on_the_same_global_batches(
    shards: Path, reference: list[dict[str, torch.Tensor]], world: int, workers: int
) -> None:
    ranks = play(shards, world, workers)
    steps = make(shards, 0, world, workers).steps_per_epoch
    assert steps == 6  # C(4, 2) pairs x 1 batch per pair
    for batches in ranks:
        assert [b.step for b in batches] == list(range(steps)), "loader order must be the step order"
    for s, per_rank in enumerate(zip(*ranks)):
        assert len({b.groups for b in per_rank}) == 1
        for b in per_rank:
            assert b.images.shape == (GLOBAL_BATCH // world, 3, 6, 6)
            assert set(b.categories.tolist()) <= set(b.groups)
        keys = [k for b in per_rank for k in b.keys]
        assert len(keys) == len(set(keys)) == GLOBAL_BATCH, "a sample twice in one global batch"
        assert set(keys) == set(reference[s]), f"step {s}: the global batch depends on the layout"
        for b in per_rank:  # augmentation is seeded per image: the same crops whatever rank decodes it
            for key, image in zip(b.keys, b.images):
                assert torch.equal(image, reference[s][key])
        labels = Counter(torch.cat([b.labels for b in per_rank]).tolist())
        assert min(labels.values()) >= 2, f"an image without a same-class partner at step {s}"
        cats = Counter(torch.cat([b.categories for b in per_rank]).tolist())
        assert sorted(cats.values()) == [GLOBAL_BATCH // 2] * 2, "half of the global batch from each category"


def test_resume_continues_the_sequence_on_another_layout(shards: Path) -> None:
    """Two epochs on 1 rank; stopped at epoch 0 step 4 and resumed on 3 ranks x 2 workers: same batches."""
    full = []
    stream = make(shards, 0, 1)
    for epoch in range(2):
        stream.set_epoch(epoch)
        full.extend(global_batches([play_rank(stream)]))
    resumed = []
    streams = [make(shards, r, 3, 2) for r in range(3)]
    for s in streams:
        s.load_state_dict({"epoch": 0, "step": 4})
    resumed.extend(global_batches([play_rank(s) for s in streams]))
    for s in streams:
        s.set_epoch(1)
    resumed.extend(global_batches([play_rank(s) for s in streams]))
    assert [sorted(b) for b in resumed] == [sorted(b) for b in full[4:]]
    assert all(torch.equal(a[k], b[k]) for a, b in zip(resumed, full[4:]) for k in a)
    assert [sorted(b) for b in full[:6]] != [sorted(b) for b in full[6:]], "epochs differ"


def test_position_wraps_into_the_next_epoch(shards: Path) -> None:
    stream = make(shards, 0, 1)
    stream.set_position(0, 6 + 2)
    assert stream.position == (1, 2) and stream.state_dict() == {"epoch": 1, "step": 2}


def test_real_dataloader_keeps_step_order_and_position(shards: Path) -> None:
    stream = make(shards, 1, 2, 2)
    stream.batch(0, 5)  # the parent reads first: forked workers must not share its open files
    loader = StreamLoader(stream)
    assert len(loader) == 6
    seen = []
    for batch in loader:
        seen.append(batch.step)
        if batch.step == 3:
            break
    assert seen == [0, 1, 2, 3]
    assert stream.state_dict()["step"] == 4
    expected = play(shards, 2, 0)[1]
    rest = list(StreamLoader(stream))
    assert [b.step for b in rest] == [4, 5]
    assert [b.keys for b in rest] == [b.keys for b in expected[4:]]
    assert stream.position == (1, 0)


def test_stream_pickles_for_spawned_workers(shards: Path) -> None:
    stream = make(shards, 1, 2, 1)
    stream.plan.step(0, 2)  # some cached plan state
    clone = pickle.loads(pickle.dumps(stream))
    assert [b.keys for b in play_rank(clone)] == [b.keys for b in play_rank(stream)]


def test_strategies_random_and_pk(shards: Path) -> None:
    for schedule, steps in (
        (ScheduleConfig(strategy="random"), 236 // 24),
        (ScheduleConfig(strategy="pk"), 220 // 24),  # at most K = 4 of each class: 4 x 55 images
    ):
        ranks = play(shards, 2, 1, schedule=schedule)
        assert len(ranks[0]) == len(ranks[1]) == steps
        for step in zip(*ranks):
            keys = [k for b in step for k in b.keys]
            assert len(keys) == len(set(keys)) == GLOBAL_BATCH


def test_unlabelled_pool(tmp_path: Path) -> None:
    """VehicleID-like: half of each batch from one labelled category, half from classes with no category."""
    write_image_folder(tmp_path / "labelled", [[3] * 8, [4] * 6])
    write_image_folder(tmp_path / "plain", [[2, 3, 4, 5] * 5])
    records = read_image_folder(tmp_path / "labelled")
    records += [r.__class__(r.path, f"u{r.cls}", None) for r in read_image_folder(tmp_path / "plain")]
    build_shards(records, tmp_path / "s", BuildOptions(max_samples=20, progress=False))
    ranks = play(tmp_path / "s", 2, 1, schedule=ScheduleConfig(strategy="hard_unlabelled"), global_batch=8)
    assert len(ranks[0]) == 6 + 6  # ceil(24 / 4) + ceil(24 / 4)
    for step in zip(*ranks):
        cats = Counter(c for b in step for c in b.categories.tolist())
        assert cats[-1] == 4 and len(cats) == 2


def test_too_small_category_is_left_out(tmp_path: Path, ddp_rank_log: pytest.LogCaptureFixture) -> None:
    write_image_folder(tmp_path / "images", [[2, 2, 2, 2, 2, 2], [3, 3, 3, 3], [2, 2, 2, 2, 2, 2], [2, 2]])
    build_shards(read_image_folder(tmp_path / "images"), tmp_path / "s", BuildOptions(progress=False))
    stream = make(tmp_path / "s", 0, 1, global_batch=12)
    assert any(
        r.levelname == "WARNING" and "cat3: a step needs 6 images, it has 4" in r.getMessage()
        for r in ddp_rank_log.records
    )
    assert stream.left_out == ["cat3: a step needs 6 images, it has 4"]
    assert stream.steps_per_epoch == 3
    assert all(3 not in b.groups for b in play_rank(stream))


# ---------------------------------------------------------------------------------------------- faults


def _damage(shards: Path, tmp: Path, how: str) -> tuple[Path, str]:
    """A copy of the shards with one shard of category 0 damaged: 'flip' one byte of its first class,
    'truncate' it in the middle, or 'delete' it."""
    bad = tmp / f"bad-{how}"
    shutil.copytree(shards, bad)
    shard = next(s for s in Manifest.load(bad).split("train").shards if s.category == 0)
    path = bad / shard.path
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[shard.classes[0].offset + 700] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    return bad, shard.path


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_unreadable_classes_are_replaced_and_counted(
    shards: Path, tmp_path: Path, how: str, ddp_rank_log: pytest.LogCaptureFixture
) -> None:
    bad, name = _damage(shards, tmp_path, how)
    spans = next(x for x in Manifest.load(bad).split("train").shards if x.path == name).classes
    every_class = ScheduleConfig(batches_per_pair=4, seed=7)  # 12 steps x 12 images of category 0 > its 59
    ranks = play(bad, 2, 1, schedule=every_class)
    assert any(name in r.getMessage() and "replaced" in r.getMessage() for r in ddp_rank_log.records)
    replaced = 0
    for step in zip(*ranks):
        keys = [k for b in step for k in b.keys]
        assert len(keys) == len(set(keys)) == GLOBAL_BATCH, "a replacement duplicated an image"
        labels = Counter(torch.cat([b.labels for b in step]).tolist())
        assert min(labels.values()) >= 2
        for b in step:
            replaced += b.events.replaced_classes
            assert b.events.bad_shards in ([], [name])
    assert replaced > 0
    drawn = {c for r in ranks for b in r for c in b.labels.tolist()}
    lost = {"flip": {spans[0].id}, "truncate": {spans[-1].id}, "delete": {s.id for s in spans}}[how]
    assert not lost & drawn, "an unreadable class reached a batch"
    assert len(drawn) > 60, "the rest of the data is still drawn"


def test_no_replacement_left_raises_one_clear_error(shards: Path, tmp_path: Path) -> None:
    bad = tmp_path / "gone"
    shutil.copytree(shards, bad)
    for shard in Manifest.load(bad).split("train").shards:
        if shard.category == 0:
            (bad / shard.path).unlink()
    stream = make(bad, 0, 1)
    with pytest.raises(DataError, match="no readable replacement") as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        play_rank(stream)
    assert "ddp-rank shards verify" in str(info.value) and "train/train-c0000" in str(info.value)


def test_rank_and_world_size_come_from_the_environment(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    stream = ShardStream(shards, GLOBAL_BATCH, transform=TINY)
    assert (stream.rank, stream.world_size, stream.local_batch) == (2, 3, 8)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="rank 3"):
        ShardStream(shards, GLOBAL_BATCH)
    with pytest.raises(ValueError, match="not divisible"):
        make(shards, 0, 5)
