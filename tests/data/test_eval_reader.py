"""The evaluation reader: every test sample exactly once over all ranks and workers, with its subset flag."""

from __future__ import annotations

import csv
import itertools
from pathlib import Path

import pytest
import torch

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_csv_listing
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.reading import transforms
from ddp_rank.data.reading.eval_reader import EvalShards, contiguous_range
from ddp_rank.data.reading.transforms import TransformConfig, normalize_batch


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("eval")
    paths = write_image_folder(root / "img", [[2, 3, 4], [3, 5], [2, 2, 2]], image_size=8)
    with (root / "list.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "class", "category", "split", "subset"])
        for i, p in enumerate(paths):
            writer.writerow([p, p.parent.name, p.parent.parent.name, "test", "query" if i % 2 else "gallery"])
    build_shards(read_csv_listing(root / "list.csv"), root / "s", BuildOptions(max_samples=4, progress=False))
    return root / "s"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_every_sample_exactly_once(shards: Path, world: int, workers: int) -> None:
    keys: list[str] = []
    for rank in range(world):
        reader = EvalShards(
            shards,
            "test",
            batch_size=3,
            transform=TransformConfig(resize=8, crop=8),
            rank=rank,
            world_size=world,
        )
        for w in range(workers):
            for batch in reader.iter_worker(w, workers):
                n = len(batch.keys)
                assert batch.images.shape == (n, 3, 8, 8) and n <= 3
                assert batch.labels.shape == batch.categories.shape == (n,)
                assert set(batch.subsets) <= {"query", "gallery"}
                keys.extend(batch.keys)
    assert len(keys) == len(set(keys)) == 23


def test_subset_flag_comes_from_the_json(shards: Path) -> None:
    batches = list(EvalShards(shards, "test", batch_size=100, transform=TransformConfig(resize=8, crop=8)))
    subsets = [s for b in batches for s in b.subsets]
    assert subsets.count("query") == 11 and subsets.count("gallery") == 12


def test_contiguous_ranges_partition() -> None:
    for total in range(0, 30):
        for parts in range(1, 6):
            ranges = [contiguous_range(total, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == total
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_transforms_shapes_and_normalisation() -> None:
    from PIL import Image

    config = TransformConfig(resize=32, crop=24)
    image = Image.new("RGB", (50, 40), (124, 116, 104))
    train = transforms.train_transform(config)(image)
    test = transforms.test_transform(config)(image)
    assert train.shape == test.shape == (3, 24, 24) and train.dtype == torch.uint8
    batch = normalize_batch([test, test], config)
    assert batch.shape == (2, 3, 24, 24) and batch.dtype == torch.float32
    assert batch.abs().max() < 0.05  # the ImageNet mean colour normalises to about 0
    with pytest.raises(ValueError, match="crop"):
        TransformConfig(resize=8, crop=16)
