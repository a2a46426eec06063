"""Property tests of the category-aware distributed stream on tiny shards written by the build code.

Ranks and DataLoader workers are simulated in one process: each (rank, worker) slot is a ShardStream built with
that rank / world size, iterated through ``iter_worker``; a rank's batches are its workers' batches interleaved
round-robin, which is what a DataLoader with ``batch_size=None`` does (one test checks that on a real one).
"""

from __future__ import annotations

import pickle
import shutil
import tarfile
import warnings
from collections import Counter
from collections.abc import Iterator
from itertools import zip_longest
from pathlib import Path
from typing import Any

import pytest
import torch

from ddp_rank.data.build import BuildOptions, build_shards
from ddp_rank.data.listing import read_image_folder
from ddp_rank.data.loader import StreamLoader
from ddp_rank.data.manifest import Manifest
from ddp_rank.data.schedule import ScheduleConfig
from ddp_rank.data.stream import ShardStream
from ddp_rank.data.synthetic import write_image_folder
from ddp_rank.data.transforms import TransformConfig

GLOBAL_BATCH = 24  # divisible by 1, 2, 3 and 4 ranks
TINY = TransformConfig(resize=8, crop=6)
# 4 categories x 17 classes of 2..5 images (59 images each): enough for 4 ranks x 3 workers.
CLASS_SIZES = [[2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3, 4, 5, 3]] * 4


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stream")
    write_image_folder(root / "images", CLASS_SIZES, image_size=8)
    out = root / "shards"
    build_shards(read_image_folder(root / "images"), out, BuildOptions(max_samples=12, progress=False))
    return out


def make(shards: Path, rank: int, world: int, workers: int, **kwargs: Any) -> ShardStream:
    schedule = kwargs.pop("schedule", ScheduleConfig(batches_per_pair=1, seed=7))
    return ShardStream(
        shards,
        kwargs.pop("global_batch", GLOBAL_BATCH),
        rank=rank,
        world_size=world,
        num_workers=workers,
        schedule=schedule,
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
    return round_robin([stream.iter_worker(w) for w in range(stream.workers)])


def play(shards: Path, world: int, workers: int, **kwargs: Any) -> list[list[dict[str, Any]]]:
    return [play_rank(make(shards, r, world, workers, **kwargs)) for r in range(world)]


LAYOUTS = [(world, workers) for world in (1, 2, 3, 4) for workers in (0, 1, 2, 3)]


@pytest.mark.parametrize(("world", "workers"), LAYOUTS)
def test_global_batch_properties(shards: Path, world: int, workers: int) -> None:
    ranks = play(shards, world, workers)
    steps = make(shards, 0, world, workers).steps_per_epoch
    assert steps == 6  # C(4, 2) pairs x 1 batch per pair
    for batches in ranks:
        assert [b["step"] for b in batches] == list(range(steps)), "loader order must be the step order"
    for s in range(steps):
        per_rank = [batches[s] for batches in ranks]
        assert len({b["groups"] for b in per_rank}) == 1, "all ranks must draw the same categories"
        for b in per_rank:
            assert b["images"].shape == (GLOBAL_BATCH // world, 3, 6, 6)
            assert b["labels"].shape == b["categories"].shape == (GLOBAL_BATCH // world,)
            assert set(b["categories"].tolist()) <= set(b["groups"])
        keys = [k for b in per_rank for k in b["keys"]]
        assert len(keys) == len(set(keys)), "a sample appears twice in one global batch"
        labels = Counter(torch.cat([b["labels"] for b in per_rank]).tolist())
        assert min(labels.values()) >= 2, f"an image without a same-class partner at step {s}: {labels}"
        cats = Counter(torch.cat([b["categories"] for b in per_rank]).tolist())
        assert sorted(cats.values()) == [GLOBAL_BATCH // 2] * 2, "half of the global batch from each category"


def test_class_coverage_over_an_epoch(shards: Path) -> None:
    """With 3 batches per pair each slot draws more images of a category than it owns (3 pairs x 3 x 12 = 108
    > 59), so every class must show up in the epoch; with 1 batch per pair (36 < 59) not all can."""
    manifest = Manifest.load(shards)
    all_classes = set(manifest.split("train").class_counts)
    for world, workers in [(1, 0), (2, 1), (3, 2)]:
        schedule = ScheduleConfig(batches_per_pair=3, seed=1)
        ranks = play(shards, world, workers, schedule=schedule)
        seen = {c for batches in ranks for b in batches for c in b["labels"].tolist()}
        assert seen == all_classes, f"classes never drawn with {world} ranks x {workers} workers"
    short = {c for b in play(shards, 1, 0)[0] for c in b["labels"].tolist()}
    assert len(short) < len(all_classes)


def test_same_stream_twice_from_the_same_seed(shards: Path) -> None:
    first, second = play(shards, 2, 2), play(shards, 2, 2)
    for a_rank, b_rank in zip(first, second):
        for a, b in zip(a_rank, b_rank):
            assert a["keys"] == b["keys"]
            assert torch.equal(a["images"], b["images"])
    other = play(shards, 2, 2, schedule=ScheduleConfig(batches_per_pair=1, seed=8))
    assert [b["keys"] for b in other[0]] != [b["keys"] for b in first[0]]


@pytest.mark.parametrize(("workers", "start"), [(0, 3), (2, 1), (3, 4)])
def test_resume_continues_exactly(shards: Path, workers: int, start: int) -> None:
    full = play(shards, 2, workers)
    for rank in range(2):
        stream = make(shards, rank, 2, workers)
        stream.load_state_dict({"epoch": 0, "step": start, "world_size": 2, "num_workers": workers})
        resumed = play_rank(stream)
        assert [b["step"] for b in resumed] == list(range(start, 6))
        for a, b in zip(full[rank][start:], resumed):
            assert a["keys"] == b["keys"]
            assert torch.equal(a["images"], b["images"])


def test_epochs_differ_and_resume_across_epochs(shards: Path) -> None:
    stream = make(shards, 0, 1, 0)
    stream.set_epoch(1)
    epoch1 = play_rank(stream)
    assert all(b["epoch"] == 1 for b in epoch1)
    assert [b["keys"] for b in epoch1] != [b["keys"] for b in play(shards, 1, 0)[0]]
    stream.set_position(0, 6 + 2)  # step 8 of 6-step epochs is epoch 1, step 2
    assert stream.position == (1, 2)
    assert [b["keys"] for b in play_rank(stream)] == [b["keys"] for b in epoch1[2:]]


def test_resume_refuses_a_different_layout(shards: Path) -> None:
    with pytest.raises(ValueError, match="world_size"):
        make(shards, 0, 2, 0).load_state_dict({"epoch": 0, "step": 1, "world_size": 4, "num_workers": 0})


def test_real_dataloader_keeps_step_order_and_position(shards: Path) -> None:
    stream = make(shards, 1, 2, 2)
    loader = StreamLoader(stream)
    assert len(loader) == 6
    seen = []
    for batch in loader:
        seen.append(batch["step"])
        if batch["step"] == 3:
            break
    assert seen == [0, 1, 2, 3]
    assert stream.state_dict()["step"] == 4
    expected = play(shards, 2, 2)[1]
    rest = list(StreamLoader(stream))
    assert [b["step"] for b in rest] == [4, 5]
    assert [b["keys"] for b in rest] == [b["keys"] for b in expected[4:]]
    assert stream.position == (1, 0)


def test_stream_pickles_for_spawned_workers(shards: Path) -> None:
    stream = make(shards, 1, 2, 1)
    stream.schedule.step(0, 0)  # fill the per-epoch cache before pickling
    clone = pickle.loads(pickle.dumps(stream))
    assert [b["keys"] for b in play_rank(clone)] == [b["keys"] for b in play_rank(stream)]


def test_wrong_worker_count_fails_loudly(shards: Path) -> None:
    stream = make(shards, 0, 1, 2)
    with pytest.raises(RuntimeError, match="num_workers=2"):
        next(iter(stream))


def test_indivisible_batch_is_refused(shards: Path) -> None:
    with pytest.raises(ValueError, match="not divisible"):
        make(shards, 0, 5, 0)


def test_too_small_category_is_left_out(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "images", [[2, 2, 2, 2, 2, 2], [3, 3, 3, 3], [2, 2, 2, 2, 2, 2], [2, 2]])
    build_shards(read_image_folder(tmp_path / "images"), tmp_path / "s", BuildOptions(progress=False))
    with pytest.warns(UserWarning, match="cat3 cannot give"):
        stream = make(tmp_path / "s", 0, 1, 0, global_batch=12)
    assert stream.skipped_categories == ["cat3"]
    assert stream.steps_per_epoch == 3
    assert all(3 not in b["groups"] for b in play_rank(stream))


def test_random_strategy(shards: Path) -> None:
    ranks = play(shards, 2, 1, schedule=ScheduleConfig(strategy="random"))
    assert len(ranks[0]) == len(ranks[1]) == 236 // GLOBAL_BATCH
    for s in range(len(ranks[0])):
        keys = [k for r in ranks for k in r[s]["keys"]]
        assert len(keys) == len(set(keys)) == GLOBAL_BATCH


def test_unlabelled_pool(tmp_path: Path) -> None:
    """VehicleID-like: half of each batch from one labelled category, half from classes with no category."""
    write_image_folder(tmp_path / "labelled", [[3] * 8, [4] * 6])
    write_image_folder(tmp_path / "plain", [[2, 3, 4, 5] * 5])
    records = read_image_folder(tmp_path / "labelled")
    records += [r.__class__(r.path, f"u{r.cls}", None) for r in read_image_folder(tmp_path / "plain")]
    build_shards(records, tmp_path / "s", BuildOptions(max_samples=20, progress=False))
    schedule = ScheduleConfig(strategy="hard_unlabelled")
    ranks = play(tmp_path / "s", 2, 1, schedule=schedule, global_batch=8)
    assert len(ranks[0]) == 6 + 6  # ceil(24 / 4) + ceil(24 / 4)
    for s in range(len(ranks[0])):
        cats = Counter(c for r in ranks for c in r[s]["categories"].tolist())
        assert cats[-1] == 4 and len(cats) == 2


def _corrupt_copy(shards: Path, tmp: Path) -> tuple[Path, str, str]:
    bad = tmp / "bad"
    shutil.copytree(shards, bad)
    shard_list = Manifest.load(bad).split("train").shards
    corrupt, truncated = shard_list[0].path, shard_list[5].path
    with open(bad / corrupt, "r+b") as f:
        f.write(b"\x00garbage" * 128)
    data = (bad / truncated).read_bytes()
    (bad / truncated).write_bytes(data[: len(data) // 2])
    return bad, corrupt, truncated


def test_corrupt_and_truncated_shards_are_survived_and_reported(shards: Path, tmp_path: Path) -> None:
    bad, corrupt, truncated = _corrupt_copy(shards, tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ranks = play(bad, 2, 2)
    messages = " ".join(str(w.message) for w in caught)
    assert corrupt in messages and truncated in messages
    reported: set[str] = set()
    for batches in ranks:
        assert len(batches) == 6
        for b in batches:
            assert b["images"].shape[0] == GLOBAL_BATCH // 2
            reported.update(b["stats"]["bad_shard_names"])
    assert reported == {corrupt, truncated}
    assert max(b["stats"]["dropped_samples"] for r in ranks for b in r) > 0


def test_undecodable_images_are_replaced_and_counted(shards: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(shards, bad)
    for shard in Manifest.load(bad).split("train").shards:
        if shard.category != 0:
            continue
        path = bad / shard.path
        data = bytearray(path.read_bytes())
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                if m.name.endswith(".png"):
                    data[m.offset_data : m.offset_data + m.size] = b"\x00" * m.size
        path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="cannot decode"):
        batches = play(bad, 1, 0)[0]
    assert all(b["images"].shape[0] == GLOBAL_BATCH for b in batches)
    with_cat0 = [b for b in batches if 0 in b["groups"]]
    assert with_cat0 and with_cat0[-1]["stats"]["decode_errors"] == 12 * len(with_cat0)


def test_rank_and_world_size_come_from_the_environment(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    stream = ShardStream(shards, GLOBAL_BATCH, transform=TINY)
    assert (stream.rank, stream.world_size, stream.local_batch) == (2, 3, 8)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ValueError, match="rank 3"):
        ShardStream(shards, GLOBAL_BATCH)
