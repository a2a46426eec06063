"""``shards build --val-fraction``: a validation split of whole training classes, seeded, recorded, leaving the
test classes as they were."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import ListingError, Record, carve_validation, read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest


def _records(categories: int = 2, classes: int = 20, test_every: int = 4) -> list[Record]:
    return [
        Record(f"/x/{g}/{c}/{i}.png", f"w{c}", f"g{g}", "test" if c % test_every == 0 else "train")
        for g in range(categories)
        for c in range(classes)
        for i in range(3)
    ]


def _val_classes(records: list[Record]) -> set[tuple[str | None, str]]:
    return {(r.category, r.cls) for r in records if r.split == "val"}


def test_whole_training_classes_per_category_and_the_test_split_untouched() -> None:
    records = _records()
    carved = carve_validation(records, 0.2, seed=3)
    val = _val_classes(carved)
    # 15 training classes per category: round(0.2 * 15) = 3 each
    assert sorted(sum(1 for g, _ in val if g == cat) for cat in ("g0", "g1")) == [3, 3]
    for before, after in zip(records, carved, strict=True):
        if before.split == "test":
            assert after == before, "a test record moved"
        elif (after.category, after.cls) in val:
            assert after.split == "val"
        else:
            assert after == before
    by_class: dict[tuple[str | None, str], set[str | None]] = {}
    for r in carved:
        by_class.setdefault((r.category, r.cls), set()).add(r.split)
    assert all(len(splits) == 1 for splits in by_class.values()), "a class cut across splits"


def test_seeded_repeatable_and_another_seed_draws_other_classes() -> None:
    records = _records()
    assert _val_classes(carve_validation(records, 0.2, 3)) == _val_classes(carve_validation(records, 0.2, 3))
    assert _val_classes(carve_validation(records, 0.2, 3)) != _val_classes(carve_validation(records, 0.2, 4))


def test_every_category_keeps_a_training_class_and_zero_changes_nothing() -> None:
    records = [Record(f"/x/{c}/{i}.png", f"w{c}", "solo" if c == 0 else "many", "train") for c in range(6)
               for i in range(2)]  # fmt: skip
    carved = carve_validation(records, 0.9, 0)
    assert {r.split for r in carved if r.category == "solo"} == {"train"}
    assert {r.cls for r in carved if r.category == "many" and r.split == "train"} != set()
    assert carve_validation(records, 0.0, 0) == records


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 1.5])
def test_a_fraction_out_of_range_is_refused(fraction: float) -> None:
    with pytest.raises(ListingError, match=r"validation fraction must be in \[0, 1\)"):
        carve_validation(_records(), fraction, 0)


def test_a_listing_with_its_own_val_split_is_not_carved_again() -> None:
    records = [*_records(), Record("/x/v/0.png", "v", "g0", "val"), Record("/x/v/1.png", "v", "g0", "val")]
    with pytest.raises(ListingError, match="already has a 'val' split"):
        carve_validation(records, 0.1, 0)


def test_the_build_writes_the_val_split_and_records_how(tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_image_folder(root, [[3] * 10, [2] * 10], image_size=8)
    options = BuildOptions(test_fraction=0.2, val_fraction=0.25, split_seed=1, progress=False)
    build_shards(read_image_folder(root), tmp_path / "with", options)
    build_shards(read_image_folder(root), tmp_path / "without", BuildOptions(test_fraction=0.2, split_seed=1,
                                                                              progress=False))  # fmt: skip
    with_val, without = Manifest.load(tmp_path / "with"), Manifest.load(tmp_path / "without")
    assert set(with_val.splits) == {"train", "val", "test"}
    assert with_val.build["val_fraction"] == 0.25 and with_val.build["split_seed"] == 1
    assert with_val.split("test").class_counts == without.split("test").class_counts, "the test draw moved"
    train, val = set(with_val.split("train").class_counts), set(with_val.split("val").class_counts)
    assert not train & val and train | val == set(without.split("train").class_counts)
    assert len(val) == 4  # 8 training classes per category: round(0.25 * 8) = 2 each
    assert all(shard.path.startswith("val/") for shard in with_val.split("val").shards)
