"""``ddp-rank shards verify``: prove a shard directory matches its manifest and every image decodes (every
vector of feature shards has its length and finite values).

Checks, per shard: the file exists, its size and sha256 match, the tar reads to the end, every class's byte
range has the manifest's digest and holds its samples (what the stream reads), and every image decodes. Problems
are returned by shard name so the CLI can print them and exit non-zero; nothing is fixed silently. One check is
of the manifest alone: no class of the train split in another split unless it records why (``class_leaks``),
named ``manifest.json``.

The shards are read where the manifest says they are (``Manifest.location``: beside it, or its ``shards_root``).
Shards made by other tools and indexed (``build.indexed``) take their classes from the manifest, so their samples
need only an image; ddp_rank's own also need the ``.cls`` and ``.json`` members it writes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from ddp_rank.data.features.records import decode_vector, feature_dim, feature_record
from ddp_rank.data.features.whitening import WhiteningError, load_whitening
from ddp_rank.data.format.class_leaks import BUILT_FIX, leak_line, manifest_leak
from ddp_rank.data.format.manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    is_url,
    sha256_file,
    span_digest,
)
from ddp_rank.data.format.tar_scan import SpanError, SpanSample, parse_span, scan_shard
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS, ImageDecodeError, decode_image


@dataclass(frozen=True)
class Problem:
    shard: str
    message: str

    def __str__(self) -> str:
        return f"{self.shard}: {self.message}"


def verify_shard(
    path: Path,
    shard: ShardInfo,
    decode: bool = True,
    labelled: bool = True,
    vector_dim: int | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> list[Problem]:
    """Every check for one shard at ``path`` (module level so worker processes can run it); ``labelled`` as in
    ``scan_shard``; ``vector_dim`` for feature shards, whose samples are vectors of that length, not images;
    images are decoded as the stream decodes them (``decode.decode_image``, limit ``max_pixels``)."""
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
    scan = scan_shard(path, expected=shard.samples, labelled=labelled)
    if scan.error is not None:
        problems.append(Problem(shard.path, scan.error))
    with path.open("rb") as f:
        for span in shard.classes:
            f.seek(span.offset)
            data = f.read(span.length)
            if span_digest(data) != span.digest:
                problems.append(
                    Problem(shard.path, f"class {span.id}: its byte range does not match its digest")
                )
            try:
                samples = parse_span(data, span.count)
            except SpanError as exc:
                problems.append(Problem(shard.path, f"class {span.id}: {exc}"))
                continue
            if decode and vector_dim is not None:
                problems.extend(_bad_vectors(samples, span.id, shard.path, vector_dim))
            elif decode:
                problems.extend(_undecodable(samples, span.id, shard.path, max_pixels))
    return problems


def _undecodable(samples: list[SpanSample], class_id: int, name: str, max_pixels: int) -> Iterator[Problem]:
    for sample in samples:
        try:
            decode_image(sample.image, name=f"{sample.key}.{sample.image_ext}", max_pixels=max_pixels)
        except ImageDecodeError as exc:
            yield Problem(name, f"class {class_id}: {exc}")


def _bad_vectors(samples: list[SpanSample], class_id: int, name: str, dim: int) -> Iterator[Problem]:
    for sample in samples:
        try:
            decode_vector(sample.image, dim)
        except ValueError as exc:
            yield Problem(name, f"class {class_id}: vector {sample.key}.{sample.image_ext} is bad: {exc}")


def verify_shards(
    directory: str | os.PathLike[str],
    decode: bool = True,
    workers: int = 1,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> list[Problem]:
    """All problems of a shard directory (empty list: it is sound); an image over ``max_pixels`` (width x
    height) is one, as in training."""
    manifest = Manifest.load(directory)
    if is_url(manifest.location):
        raise ValueError(
            f"the shards of {directory} are at {manifest.location}: verify reads local files; copy the shards "
            "to this machine, index the copy (`ddp-rank shards index COPY`) and verify that"
        )
    shards = [s for split in manifest.splits.values() for s in split.shards]
    paths = [manifest.shard_path(s) for s in shards]
    check = partial(
        verify_shard,
        decode=decode,
        labelled=not manifest.build.get("indexed", False),
        vector_dim=feature_dim(manifest),
        max_pixels=max_pixels,
    )
    if workers > 1 and len(shards) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(check, paths, shards))
    else:
        results = [check(p, s) for p, s in zip(paths, shards)]
    problems = [p for r in results for p in r]
    problems += _whitening_problems(manifest, os.fspath(directory))
    leak = manifest_leak(manifest)
    if leak is not None:
        problems.append(Problem(MANIFEST_NAME, leak_line("splits", leak, BUILT_FIX)))
    for split in manifest.splits.values():
        listed = sum(s.samples for s in split.shards)
        counted = sum(split.class_counts.values())
        if listed != counted:
            problems.append(
                Problem(split.name, f"shards hold {listed} samples but the class counts add to {counted}")
            )
    return problems


def _whitening_problems(manifest: Manifest, root: str) -> list[Problem]:
    """Whitened feature shards: their map must be there, with the sha256 and shape the record names."""
    record = feature_record(manifest)
    if record is None or record.whitening is None:
        return []
    try:
        whitening = load_whitening(root, record.whitening)
    except WhiteningError as exc:
        return [Problem(record.whitening.file, str(exc))]
    if whitening.dim != record.dim:
        return [
            Problem(record.whitening.file, f"maps to {whitening.dim} values, the vectors hold {record.dim}")
        ]
    return []
