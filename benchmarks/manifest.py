"""What checking ``manifest.json`` costs at load: ``Manifest.load`` (parse + every field checked,
``ddp_rank.data.format.manifest_check``) against ``json.loads`` alone and against building the same objects while
trusting the file (what the loader did before the checks), on manifests of 20,000 and 200,000 classes (five
images each, 500 classes a shard, 100 categories). Times are CPU seconds of this process (the best of three),
so other load on the machine weighs less.

    python -m benchmarks.manifest            # prints the table, writes benchmarks/results/manifest-<date>.md
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table, write_result
from ddp_rank.data.format.manifest import ClassInfo, ClassSpan, Manifest, ShardInfo, SplitInfo

SAMPLE_BYTES = 3 * 1024


def synthetic(n_classes: int, per_class: int = 5, per_shard: int = 500, n_categories: int = 100) -> Manifest:
    classes = tuple(ClassInfo(i, f"class-{i}", i % n_categories) for i in range(n_classes))
    shards = []
    for c in range(n_categories):
        members = list(range(c, n_classes, n_categories))
        for start in range(0, len(members), per_shard):
            spans = tuple(
                ClassSpan(cid, per_class, j * per_class * SAMPLE_BYTES, per_class * SAMPLE_BYTES, "0" * 32)
                for j, cid in enumerate(members[start : start + per_shard])
            )
            size = len(spans) * per_class * SAMPLE_BYTES
            shards.append(
                ShardInfo(f"train/c{c:03d}-{start:06d}.tar", c, spans, per_class * len(spans), size, "0" * 64)
            )
    counts = dict.fromkeys(range(n_classes), per_class)
    categories = tuple(f"category-{c}" for c in range(n_categories))
    return Manifest(categories, classes, {"train": SplitInfo("train", counts, tuple(shards))})


def trusting(data: dict[str, Any], root: str) -> Manifest:
    """The same objects built without a single check (the loader before ``manifest_check``)."""
    splits = {
        name: SplitInfo(
            name,
            {c["id"]: c["count"] for c in raw["classes"]},
            tuple(
                ShardInfo(
                    s["path"],
                    s["category"],
                    tuple(ClassSpan(*row) for row in s["classes"]),
                    s["samples"],
                    s["bytes"],
                    s["sha256"],
                )
                for s in raw["shards"]
            ),
        )
        for name, raw in data["splits"].items()
    }
    classes = tuple(ClassInfo(**c) for c in data["classes"])
    return Manifest(tuple(data["categories"]), classes, splits, dict(data.get("build", {})), root)


def best_cpu(fn: Callable[[], object], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (20_000, 200_000):
            directory = Path(tmp) / str(n)
            directory.mkdir()
            synthetic(n).save(directory)
            raw = (directory / "manifest.json").read_bytes()
            parse = best_cpu(lambda raw=raw: json.loads(raw))
            data = json.loads(raw)
            trusted = best_cpu(lambda data=data, d=directory: trusting(data, str(d)))
            checked_build = best_cpu(lambda data=data, d=directory: Manifest.from_json(data, d))
            load = best_cpu(lambda d=directory: Manifest.load(d))
            rows.append(
                [
                    f"{n:,}",
                    f"{len(raw) / 1e6:.1f} MB",
                    f"{parse:.2f}",
                    f"{trusted:.2f}",
                    f"{checked_build:.2f}",
                    f"{load:.2f}",
                    f"{checked_build / trusted:.1f}x",
                ]
            )
    header = [
        "classes",
        "manifest",
        "json.loads (s)",
        "build, trusting (s)",
        "build, checked (s)",
        "Manifest.load (s)",
        "checked / trusting",
    ]
    table = markdown_table(header, rows)
    print(table)
    path = write_result(
        "manifest",
        "Loading manifest.json with every field checked",
        f"CPU seconds, best of 3 (`python -m benchmarks.manifest`).\n\n{table}",
    )
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
