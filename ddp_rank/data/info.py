"""``ddp-rank shards info``: a table per split and category, read from the manifest alone."""

from __future__ import annotations

import os
from collections import defaultdict

from ddp_rank.data.manifest import Manifest


def info_rows(manifest: Manifest) -> list[tuple[str, str, int, int, int, float]]:
    """(split, category, classes, images, shards, MB) per split and category, plus a total row per split."""
    rows = []
    for name, split in sorted(manifest.splits.items()):
        per: dict[int | None, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
        for cid, n in split.class_counts.items():
            entry = per[manifest.classes[cid].category]
            entry[0] += 1
            entry[1] += n
        for shard in split.shards:
            entry = per[shard.category]
            entry[2] += 1
            entry[3] += shard.bytes
        for category in sorted(per, key=lambda c: (c is None, c or 0)):
            classes, images, shards, size = per[category]
            rows.append((name, manifest.category_name(category), classes, images, shards, size / 2**20))
        totals = [sum(v[i] for v in per.values()) for i in range(4)]
        rows.append((name, "TOTAL", totals[0], totals[1], totals[2], totals[3] / 2**20))
    return rows


def format_info(directory: str | os.PathLike[str]) -> str:
    manifest = Manifest.load(directory)
    header = ("split", "category", "classes", "images", "shards", "MB")
    body = [(s, c, str(k), str(i), str(n), f"{mb:.1f}") for s, c, k, i, n, mb in info_rows(manifest)]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        for r in [header, *body]
    ]
    return "\n".join(lines)
