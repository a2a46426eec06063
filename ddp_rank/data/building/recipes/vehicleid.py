"""PKU VehicleID (Liu et al. 2016): ``train_test_split/*.txt`` and ``attribute/model_attr.txt``.

List lines are ``<image name> <vehicle id>``; images are ``image/<name>.jpg``. ``model_attr.txt`` lines are
``<vehicle id> <model id>`` and cover only part of the vehicles: the model is the category (250 in the train
set), vehicles without one are unlabelled and feed the unlabelled pool of the ``hard_unlabelled`` schedule.
Splits: ``train`` and the three test protocols ``test_small`` / ``test_medium`` / ``test_large`` (800 / 1,600 /
2,400 vehicles); an image can be in several test splits, each is written separately.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddp_rank.data.building.listing import ListingError, Record

SPLIT_FILES = {
    "train": "train_list.txt",
    "test_small": "test_list_800.txt",
    "test_medium": "test_list_1600.txt",
    "test_large": "test_list_2400.txt",
}


def _pairs(path: Path) -> list[tuple[str, str]]:
    if not path.is_file():
        raise ListingError(
            f"{path} not found: ROOT must be the VehicleID folder (train_test_split/, attribute/, image/)"
        )
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 2:
            raise ListingError(f"{path}:{n}: expected two fields, got {line!r}")
        out.append((fields[0], fields[1]))
    return out


def records(root: str | os.PathLike[str]) -> list[Record]:
    base = Path(root)
    model = dict(_pairs(base / "attribute" / "model_attr.txt"))
    out = []
    for split, name in SPLIT_FILES.items():
        for image, vehicle in _pairs(base / "train_test_split" / name):
            category = f"model_{model[vehicle]}" if vehicle in model else None
            out.append(
                Record(path=str(base / "image" / f"{image}.jpg"), cls=vehicle, category=category, split=split)
            )
    return out
