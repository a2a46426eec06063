"""What ``shards reshard`` reads when its source has no ``manifest.json``: shards to index first, compressed or not.

A source without a manifest (a directory of shards, a brace pattern, ``--split NAME=PATTERN``; see
``shard_sources``) is indexed with the options of ``shards index`` (``--class-field`` ...) into the destination's
work folder ``DST/.reshard/source/``, and resharded from there:

- plain tars are indexed in place (the manifest in the work folder points at them; nothing is copied);
- when any shard is compressed (``.tar.gz`` and kin, told by its bytes: ``compressed``), every shard of the source
  is decompressed (a plain one copied) once, sequentially and in blocks, into the work folder, as ``x.tar`` for
  ``x.tar.gz``; that copy is indexed and resharded, and removed with the work folder when the reshard ends. The
  cost: one decompression of each shard, and its uncompressed size on disk until the end, on top of the output.

Each decompressed shard is written under a temporary name and renamed when whole, so a reshard killed while
decompressing keeps the shards it finished and redoes the rest when rerun. ``settings`` records the source's
shards (with their sizes, for a local source), so a rerun over changed shards is refused, not mixed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from ddp_rank.data.building.shard_index import IndexOptions, index_shards
from ddp_rank.data.building.shard_sources import ShardIndexError, source_splits, split_source
from ddp_rank.data.format.compressed import (
    DecompressError,
    compressed_suffix,
    compression_of,
    decompress,
    plain_name,
)
from ddp_rank.data.format.manifest import MANIFEST_NAME, Manifest, is_url, join_location

WORK = "source"
"""Sub-folder of the reshard's state folder holding the source's manifest (and its decompressed copy)."""


def has_manifest(source: str | os.PathLike[str], splits: list[str] | tuple[str, ...]) -> bool:
    """Whether ``source`` is read through its manifest: anything but a pattern, a local directory without
    ``manifest.json`` or a URL with ``--split``s (a missing directory goes to ``Manifest.load``, which names it)."""
    root, pattern = split_source(source)
    if pattern is not None:
        return False
    if is_url(root):
        return not splits
    return not Path(root).is_dir() or (Path(root) / MANIFEST_NAME).is_file()


def source_settings(
    source: str | os.PathLike[str], splits: list[str] | tuple[str, ...], index: IndexOptions
) -> tuple[str, dict[str, list[str]], dict[str, Any]]:
    """(root, split -> shards, what a resumed reshard must find unchanged) of a source without a manifest."""
    try:
        root, found = source_splits(source, list(splits), compressed=True)
    except ShardIndexError as exc:
        if splits or split_source(source)[1] is not None:
            raise
        raise ShardIndexError(f"{source} holds no {MANIFEST_NAME}, and {exc}") from exc
    sizes: dict[str, dict[str, int | None]] = {
        name: {rel: None if is_url(root) else os.path.getsize(join_location(root, rel)) for rel in rels}
        for name, rels in found.items()
    }
    index_json = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(index).items()}
    return root, found, {"source_shards": sizes, "index": index_json}


def indexed_source(
    root: str,
    found: dict[str, list[str]],
    index: IndexOptions,
    work: Path,
    progress: bool,
    shared_classes: str | None = None,
) -> Manifest:
    """Index the shards ``found`` under ``root`` into ``work`` (decompressed there first when any is
    compressed, see the module docstring); the manifest, loaded from ``work``. ``shared_classes``: as
    ``index_shards`` takes it (splits that share classes are refused without it)."""
    work.mkdir(parents=True, exist_ok=True)
    if any(_compression(root, rel) is not None for rels in found.values() for rel in rels):
        found = _decompressed(root, found, work, progress)
        index_shards(work, found, index, shared_classes=shared_classes).manifest.save(work)
    else:
        index_shards(root, found, index, out=work, shared_classes=shared_classes).manifest.save(work)
    return Manifest.load(work)


def _compression(root: str, rel: str) -> str | None:
    """The compression of a shard, by its first bytes (a name alone can lie either way)."""
    location = join_location(root, rel)
    if is_url(location):
        import fsspec

        fs, path = fsspec.core.url_to_fs(location)
        return compression_of(fs.cat_file(path, start=0, end=16))
    with open(location, "rb") as f:
        return compression_of(f.read(16))


def _decompressed(root: str, found: dict[str, list[str]], work: Path, progress: bool) -> dict[str, list[str]]:
    """Decompress (or copy) every shard of ``found`` into ``work``; split -> the plain copies' paths there."""
    out: dict[str, list[str]] = {}
    total = sum(len(rels) for rels in found.values())
    with tqdm(total=total, unit="shard", desc="decompress", disable=not progress) as bar:
        for name, rels in found.items():
            named: dict[str, str] = {}
            for rel in rels:
                plain = plain_name(rel) if compressed_suffix(rel) else rel
                if plain in named:
                    raise DecompressError(
                        f"{join_location(root, named[plain])} and {join_location(root, rel)} both decompress "
                        f"to {plain}: keep one of them in the source"
                    )
                named[plain] = rel
                target = work / plain
                if not target.is_file():  # a rerun keeps the copies a killed run finished
                    _write_plain(join_location(root, rel), target)
                bar.update(1)
            out[name] = list(named)
    return out


def _write_plain(location: str, target: Path) -> None:
    """The plain tar of the shard at ``location`` written to ``target``, whole or not at all."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    with _open(location) as src, open(partial, "wb") as dst:
        compression = compression_of(src.read(16))
        src.seek(0)
        if compression is None:
            shutil.copyfileobj(src, dst, 1 << 20)
        else:
            decompress(src, dst, compression, location)
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(partial, target)


def _open(location: str) -> IO[bytes]:
    if not is_url(location):
        return open(location, "rb")
    import fsspec

    f: IO[bytes] = fsspec.open(location, "rb").open()
    return f
