"""Stanford Online Products (Oh Song et al. 2016): ``Ebay_train.txt`` / ``Ebay_test.txt``.

Each index line is ``image_id class_id super_class_id path`` (after a header line); the path's first folder
names the super class (``bicycle_final`` -> ``bicycle``), which is the category FastAP's hard sampling uses (12
categories). The files' own train/test division is kept: 11,318 train classes, 11,316 disjoint test classes.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddp_rank.data.building.listing import ListingError, Record

SPLIT_FILES = {"train": "Ebay_train.txt", "test": "Ebay_test.txt"}


def records(root: str | os.PathLike[str]) -> list[Record]:
    base = Path(root)
    out = []
    for split, name in SPLIT_FILES.items():
        index = base / name
        if not index.is_file():
            raise ListingError(f"{index} not found: ROOT must be the Stanford_Online_Products folder")
        lines = index.read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines[1:], start=2):
            fields = line.split()
            if not fields:
                continue
            if len(fields) != 4:
                raise ListingError(
                    f"{index}:{n}: expected 'image_id class_id super_class_id path', got {line!r}"
                )
            _, class_id, _, rel = fields
            category = rel.split("/")[0].removesuffix("_final")
            out.append(Record(path=str(base / rel), cls=class_id, category=category, split=split))
    return out
