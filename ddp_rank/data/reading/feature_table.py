"""Every vector of a feature split, read once per run: one array, gathered by row index at each step.

A feature sample is a few hundred bytes, so reading it per step (a ranged read, a tar walk, a Python object per
sample) costs more than the head's whole step at small global batches. ``load_feature_table`` reads each class of
the split once through the checked reader (``ClassReader``: the manifest's digests, the node-local cache, the
retries), in the reader's order (manifest order), into one float16 array ``[rows, dim]``; ``starts[c]`` is the
row of class ``c``'s first sample, so sample ``i`` of class ``c`` is row ``starts[c] + i``, the same sample a
plan's ``Piece(c, images=[..., i, ...])`` names.

Below ``memory_map_bytes`` the array is held in this process, widened to float32 once (numpy's float16 conversion
would cost more per step than the head itself). Above it, and when a directory is given, it is
written once to ``<directory>/features-<KEY>.f16`` (raw float16, rows after rows) with its index beside it in
``features-<KEY>.json``, both written atomically (``atomic_io``), and memory-mapped: every rank of a node, and
every later run, shares the same pages through the page cache. ``KEY`` is a digest of the split's shards
(paths, sha256, spans and their digests) and the vector length, so a changed shard set gets a new file and is
never read stale. One process builds a file while the others of the node wait on ``features-<KEY>.lock``.

A class that does not read is not in the table; its error (``failures``) is raised whenever a step asks for
it, and a row that does not decode (``bad_rows``) fails its class whenever a step takes that row, so the stream
replaces such a class from the plan's reserve exactly as the per-sample path does. A table with either is never
written to the shared file (the next run reads those classes again).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ddp_rank.atomic_io import atomic_write_bytes, atomic_write_text
from ddp_rank.data.features.records import FEATURE_DTYPE
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.reader import ClassReader, ClassReadError

__all__ = ["MEMORY_MAP_BYTES", "FeatureTable", "load_feature_table", "table_key"]

MEMORY_MAP_BYTES = 256 * 2**20
"""Vectors above this size (256 MiB: 260,000 vectors of 512) are memory-mapped from one shared file when a
directory for it is given; below it each process holds its own float32 array (twice the bytes, but a step's
gather is then a plain copy)."""

_FORMAT = 1
"""Bumped when the file's layout changes: part of the key, so an old file is never read as a new one."""


@dataclass
class FeatureTable:
    """The vectors of one split, with where each class starts; see the module docstring."""

    vectors: np.ndarray
    """``[rows, dim]``: float32 held in memory, or float16 memory-mapped (read-only); the same values."""
    starts: np.ndarray
    """int64, indexed by class id: the row of the class's first sample (-1: not in the table)."""
    keys: np.ndarray
    """The sample key of each row (an object array, so a step's keys are one fancy index)."""
    failures: dict[int, ClassReadError] = field(default_factory=dict)
    """Classes that did not read (missing shard, digest mismatch, ...), with the error their reading raised."""
    bad_rows: dict[int, str] = field(default_factory=dict)
    """Rows whose bytes do not decode (wrong length, non-finite value; held as zeros), with the reason: a step
    that takes one fails its class as the per-sample decoder would."""
    path: Path | None = None
    """The memory-mapped file, None for an array held in memory."""

    @property
    def nbytes(self) -> int:
        return int(self.vectors.nbytes)


def table_key(manifest: Manifest, split: str, dim: int) -> str:
    """A digest of everything the table's content depends on: the split's shards and the vector length."""
    h = hashlib.sha256(f"feature-table {_FORMAT} {split} {dim}".encode())
    for shard in manifest.split(split).shards:
        h.update(f"\n{shard.path} {shard.sha256} {shard.samples}".encode())
        for span in shard.classes:
            h.update(f" {span.id}:{span.count}:{span.offset}:{span.length}:{span.digest}".encode())
    return h.hexdigest()[:32]


def load_feature_table(
    reader: ClassReader,
    manifest: Manifest,
    split: str,
    dim: int,
    directory: str | os.PathLike[str] | None = None,
    memory_map_bytes: int = MEMORY_MAP_BYTES,
) -> FeatureTable:
    """The split's table: memory-mapped from ``directory`` when the vectors exceed ``memory_map_bytes`` (built
    there first if absent), else read into memory."""
    rows = sum(span.count for shard in manifest.split(split).shards for span in shard.classes)
    if directory is None or rows * dim * FEATURE_DTYPE.itemsize <= memory_map_bytes:
        table, _ = _read_table(reader, manifest, split, dim)
        # Converted once here, so that a step's gather is a copy (numpy's float16 conversion costs 3 ms per
        # 1,024 x 512 vectors, more than the head's step at that batch).
        table.vectors = table.vectors.astype(np.float32)
        return table
    base = Path(directory) / f"features-{table_key(manifest, split, dim)}"
    base.parent.mkdir(parents=True, exist_ok=True)
    with open(base.with_suffix(".lock"), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process of the node builds; the others then map its file
        mapped = _map_table(base, dim)
        if mapped is not None:
            return mapped
        table, data = _read_table(reader, manifest, split, dim)
        if (
            table.failures or table.bad_rows
        ):  # never shared: held by this process alone, as below the threshold
            table.vectors = table.vectors.astype(np.float32)
            return table
        index = {
            "dim": dim,
            "rows": len(table.keys),
            "starts": table.starts.tolist(),
            "keys": table.keys.tolist(),
        }
        # The index first: a vectors file in place always has its index beside it.
        atomic_write_text(base.with_suffix(".json"), json.dumps(index))
        atomic_write_bytes(base.with_suffix(".f16"), data)
        mapped = _map_table(base, dim)
    assert mapped is not None, f"{base}.f16 was just written"
    return mapped


def _map_table(base: Path, dim: int) -> FeatureTable | None:
    """The table of a file written before, memory-mapped; None when there is none (or it is not whole)."""
    vectors_path, index_path = base.with_suffix(".f16"), base.with_suffix(".json")
    if not vectors_path.is_file() or not index_path.is_file():
        return None
    index = json.loads(index_path.read_text())
    rows = int(index["rows"])
    if index["dim"] != dim or vectors_path.stat().st_size != rows * dim * FEATURE_DTYPE.itemsize:
        return None  # a file another layout wrote: rebuilt (the key makes this all but impossible)
    vectors = np.memmap(vectors_path, dtype=FEATURE_DTYPE, mode="r", shape=(rows, dim))
    keys = np.array(index["keys"], dtype=object)
    return FeatureTable(vectors, np.array(index["starts"], dtype=np.int64), keys, path=vectors_path)


def _read_table(reader: ClassReader, manifest: Manifest, split: str, dim: int) -> tuple[FeatureTable, bytes]:
    """Read every class of the split (in the reader's order) into one array; with the bytes it views (float16,
    rows after rows: what the shared file holds)."""
    starts = np.full(len(manifest.classes), -1, dtype=np.int64)
    blocks: list[bytes] = []
    keys: list[str] = []
    failures: dict[int, ClassReadError] = {}
    bad_rows: dict[int, str] = {}
    width = dim * FEATURE_DTYPE.itemsize
    for class_id in reader.where:
        try:
            samples = reader.read(class_id)
        except ClassReadError as exc:
            failures[class_id] = exc
            continue
        first = len(keys)
        starts[class_id] = first
        for i, sample in enumerate(samples):
            if len(sample.image) != width:
                bad_rows[first + i] = (
                    f"{len(sample.image)} bytes where a vector of {dim} float16 values takes {width}"
                )
        blocks.extend(s.image if len(s.image) == width else bytes(width) for s in samples)
        keys.extend(s.key for s in samples)
    data = b"".join(blocks)
    vectors = np.frombuffer(data, dtype=FEATURE_DTYPE).reshape(len(keys), dim)
    for row in np.flatnonzero(~np.isfinite(vectors).all(axis=1)).tolist():
        bad_rows.setdefault(row, "the vector holds a non-finite value")
    return FeatureTable(vectors, starts, np.array(keys, dtype=object), failures, bad_rows), data
