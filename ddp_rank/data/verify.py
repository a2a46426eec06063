"""``ddp-rank shards verify``: prove a shard directory matches its manifest and every image decodes.

Checks, per shard: the file exists, its size and sha256 match, the tar reads to the end, the samples and their
classes are those the manifest lists (in order), and every image decodes. Problems are returned by shard name
so the CLI can print them and exit non-zero; nothing is fixed silently.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from ddp_rank.data.manifest import Manifest, ShardInfo, sha256_file
from ddp_rank.data.tario import MemberReader, SampleEntry, scan_shard


@dataclass(frozen=True)
class Problem:
    shard: str
    message: str

    def __str__(self) -> str:
        return f"{self.shard}: {self.message}"


def verify_shard(root: Path, shard: ShardInfo, decode: bool = True) -> list[Problem]:
    """Every check for one shard (module level so worker processes can run it)."""
    path = root / shard.path
    if not path.is_file():
        return [Problem(shard.path, "missing file")]
    problems = []
    size = path.stat().st_size
    if size != shard.bytes:
        problems.append(Problem(shard.path, f"size {size} bytes, manifest says {shard.bytes}"))
    digest = sha256_file(path)
    if digest != shard.sha256:
        problems.append(
            Problem(
                shard.path, f"sha256 {digest[:12]}... does not match the manifest's {shard.sha256[:12]}..."
            )
        )
    scan = scan_shard(path, expected=shard.samples)
    if scan.error is not None:
        problems.append(Problem(shard.path, scan.error))
    found = _class_runs([e.class_id for e in scan.samples])
    if found != [tuple(pair) for pair in shard.classes]:
        problems.append(
            Problem(
                shard.path,
                f"classes/counts {found[:5]}... differ from the manifest's {list(shard.classes)[:5]}...",
            )
        )
    if decode:
        problems.extend(_undecodable(path, scan.samples, shard.path))
    return problems


def _class_runs(class_ids: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for cid in class_ids:
        if runs and runs[-1][0] == cid:
            runs[-1] = (cid, runs[-1][1] + 1)
        else:
            runs.append((cid, 1))
    return runs


def _undecodable(path: Path, samples: list[SampleEntry], name: str) -> Iterator[Problem]:
    reader = MemberReader()
    try:
        for entry in samples:
            try:
                data = reader.read(path, entry.image_offset, entry.image_size)
                with Image.open(io.BytesIO(data)) as im:
                    im.load()
            except (OSError, UnidentifiedImageError, SyntaxError, ValueError, EOFError) as exc:
                yield Problem(name, f"image {entry.key}.{entry.image_ext} does not decode: {exc}")
    finally:
        reader.close()


def verify_shards(directory: str | os.PathLike[str], decode: bool = True, workers: int = 1) -> list[Problem]:
    """All problems of a shard directory (empty list: it is sound)."""
    manifest = Manifest.load(directory)
    root = Path(directory)
    shards = [s for split in manifest.splits.values() for s in split.shards]
    check = partial(verify_shard, root, decode=decode)
    if workers > 1 and len(shards) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(check, shards))
    else:
        results = [check(s) for s in shards]
    problems = [p for r in results for p in r]
    for split in manifest.splits.values():
        listed = sum(s.samples for s in split.shards)
        counted = sum(split.class_counts.values())
        if listed != counted:
            problems.append(
                Problem(split.name, f"shards hold {listed} samples but the class counts add to {counted}")
            )
    return problems
