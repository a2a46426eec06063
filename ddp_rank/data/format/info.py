"""``ddp-rank shards info``: a table per split and category, and each split's fragmentation, from the manifest alone.

A shard of ddp_rank's own layout holds one category. A shard indexed in place may mix categories (its
``category`` is null): it is then counted under each category it holds, its bytes shared out by the spans of
each category's classes; the split's total counts every shard once.
"""

from __future__ import annotations

import os
from collections import defaultdict

from ddp_rank.data.format.fragmentation import fragmentation
from ddp_rank.data.format.manifest import Manifest, ShardInfo


def info_rows(manifest: Manifest) -> list[tuple[str, str, int, int, int, float]]:
    """(split, category, classes, images, shards, MB) per split and category, plus a total row per split."""
    rows = []
    for name, split in sorted(manifest.splits.items()):
        per: dict[int | None, list[float]] = defaultdict(lambda: [0, 0, 0, 0.0])
        for cid, n in split.class_counts.items():
            entry = per[manifest.classes[cid].category]
            entry[0] += 1
            entry[1] += n
        for shard in split.shards:
            for category, nbytes in _bytes_by_category(manifest, shard).items():
                entry = per[category]
                entry[2] += 1
                entry[3] += nbytes
        for category in sorted(per, key=lambda c: (c is None, c or 0)):
            classes, images, shards, size = per[category]
            rows.append(
                (name, manifest.category_name(category), int(classes), int(images), int(shards), size / 2**20)
            )
        total_bytes = sum(s.bytes for s in split.shards)
        total_images = sum(split.class_counts.values())
        rows.append(
            (name, "TOTAL", len(split.class_counts), total_images, len(split.shards), total_bytes / 2**20)
        )
    return rows


def _bytes_by_category(manifest: Manifest, shard: ShardInfo) -> dict[int | None, float]:
    """A shard's bytes by category: all of them to its category, or shared by span bytes when it mixes them."""
    if shard.category is not None or not shard.classes:
        return {shard.category: float(shard.bytes)}
    spans: dict[int | None, int] = defaultdict(int)
    for span in shard.classes:
        spans[manifest.classes[span.id].category] += span.length
    total = sum(spans.values()) or 1
    return {category: shard.bytes * n / total for category, n in spans.items()}


def fragmentation_lines(manifest: Manifest, shards: str = "DIR") -> list[str]:
    """One line per split: its spans per class and span size, and what to do when remote reads would be
    request-bound (``fragmentation.Fragmentation.advice``)."""
    lines = []
    for name in sorted(manifest.splits):
        frag = fragmentation(manifest, name)
        lines.append(f"{name}: {frag.summary()}")
        advice = frag.advice(shards)
        if advice is not None:
            lines.append(f"  {advice}")
    return lines


def format_info(directory: str | os.PathLike[str]) -> str:
    manifest = Manifest.load(directory)
    header = ("split", "category", "classes", "images", "shards", "MB")
    body = [(s, c, str(k), str(i), str(n), f"{mb:.1f}") for s, c, k, i, n, mb in info_rows(manifest)]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = [
        "  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        for r in [header, *body]
    ]
    shared = [] if manifest.shared_classes is None else [_shared_line(manifest.shared_classes)]
    return "\n".join([*lines, "", *fragmentation_lines(manifest, os.fspath(directory)), *shared])


def _shared_line(reason: str) -> str:
    """The protocol a set records (``--shared-classes``): why its train classes may be in other splits."""
    return f"shared classes: {reason} (recorded with --shared-classes: train classes may be in other splits)"
