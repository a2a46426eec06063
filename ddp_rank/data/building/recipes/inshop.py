"""In-Shop Clothes Retrieval (DeepFashion, Liu et al. 2016): ``list_eval_partition.txt``.

Lines (after a count line and a header) are ``img/<GENDER>/<Type>/<item_id>/<file>.jpg item_id status`` with
status train / query / gallery. Category = ``<GENDER>/<Type>`` from the path (23 categories, e.g.
``WOMEN/Dresses``); class = item id. Query and gallery images form the ``test`` split, with ``subset`` saying
which, so the evaluation can run the query-vs-gallery protocol. An item filed under two types is given the
type most of its images have (ties: the first by name), as a class must have one category.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from pathlib import Path

from ddp_rank.data.building.listing import ListingError, Record

_STATUS = {"train": ("train", None), "query": ("test", "query"), "gallery": ("test", "gallery")}


def _find(base: Path, *candidates: str) -> Path:
    for c in candidates:
        if (base / c).exists():
            return base / c
    raise ListingError(
        f"none of {list(candidates)} found under {base}: ROOT must be the In-shop dataset folder"
    )


def records(root: str | os.PathLike[str]) -> list[Record]:
    base = Path(root)
    index = _find(
        base, "list_eval_partition.txt", "Eval/list_eval_partition.txt", "Anno/list_eval_partition.txt"
    )
    image_root = base / "Img" if (base / "Img").is_dir() else base
    rows = []
    for n, line in enumerate(index.read_text(encoding="utf-8").splitlines()[2:], start=3):
        fields = line.split()
        if not fields:
            continue
        if len(fields) != 3 or fields[2] not in _STATUS:
            raise ListingError(f"{index}:{n}: expected 'path item_id train|query|gallery', got {line!r}")
        rows.append(fields)
    votes: dict[str, Counter[str]] = defaultdict(Counter)
    for rel, item, _ in rows:
        votes[item]["/".join(rel.split("/")[1:3])] += 1
    category = {item: min(c, key=lambda k: (-c[k], k)) for item, c in votes.items()}
    out = []
    for rel, item, status in rows:
        split, subset = _STATUS[status]
        out.append(
            Record(path=str(image_root / rel), cls=item, category=category[item], split=split, subset=subset)
        )
    return out
