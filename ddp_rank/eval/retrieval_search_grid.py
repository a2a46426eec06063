"""The picture of ``ddp-rank search --grid``: ad-hoc query images and their hits in an exported collection.

The hits' thumbnails are read back from what the export recorded as its source: a split of shards (by class),
an image folder (the key is the file's relative path) or WebDataset shards at a URL (read in order until every
key shown is found), each through the data layer's checked reader. An ad-hoc query has no class, so the frames say whether each hit shares the class of the
query's top-1 (which is framed grey: the reference): green the same class, red another; hits without a class (an
image folder export) are all framed grey.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddp_rank.data.format.manifest import IMAGE_EXTENSIONS, Manifest, confined_join
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS
from ddp_rank.data.reading.named_shards import NamedShards, ShardReadError
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.eval.retrieval_grid import Cell, GridLayout, draw_grid, save_png
from ddp_rank.eval.retrieval_record import ImageFetch, RecordError, ShardImages, decode_thumbnail

log = logging.getLogger(__name__)

__all__ = ["draw_search_grid", "export_images", "folder_images", "url_images"]


def folder_images(root: str | os.PathLike[str], max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageFetch:
    """``fetch`` for an image folder export: the key is the file's path relative to ``root`` (kept inside it)."""

    def fetch(label: int, key: str) -> Any:
        try:
            path = confined_join(os.fspath(root), key)
            return decode_thumbnail(Path(path).read_bytes(), key, max_pixels)
        except (OSError, ValueError) as exc:
            log.warning(f"retrieval picture: cannot read {key} under {root}: {exc}")
            return None

    return fetch


def export_images(
    source: Mapping[str, Any],
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    cache_dir: str | os.PathLike[str] | ShardCache | None = None,
) -> tuple[ImageFetch, Callable[[], None]]:
    """(``fetch``, ``close``) for the items of an export, by its recorded ``source``: a split of shards (read by
    class), an image folder (the key is the relative path) or WebDataset shards at a URL (read in order until
    every key asked for is found: :func:`url_images`); shards of a URL kept in the node-local ``cache_dir``."""
    kind = source.get("kind")
    if kind == "split":
        reader = ShardImages(
            Manifest.load(str(source["shards"])), str(source["split"]), cache_dir, max_pixels=max_pixels
        )
        return reader, reader.close
    if kind == "images":
        return folder_images(str(source["folder"]), max_pixels), lambda: None
    if kind == "shards_url":
        return url_images(str(source["url"]), max_pixels, cache_dir), lambda: None
    raise RecordError(f"the export's source {dict(source)} names no image source to draw")


def url_images(
    url: str,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    cache_dir: str | os.PathLike[str] | ShardCache | None = None,
) -> ImageFetch:
    """``fetch`` for WebDataset shards at ``url`` (brace patterns expand), read through the data layer's checked
    path (``data.reading.named_shards``): the first call reads the shards in order once, keeping the images of the keys
    announced with ``fetch.want(keys)`` before it (as :func:`draw_search_grid` does), and stops when it holds
    them all. A shard that cannot be read is named in one warning and passed over (its hits show no picture)."""
    wanted: set[str] = set()
    found: dict[str, bytes] = {}
    scanned = False

    def scan() -> None:
        try:
            shards = NamedShards(url, cache_dir=cache_dir)
        except ShardReadError as exc:
            log.warning(f"retrieval picture: {exc}")
            return
        try:
            for shard in shards.urls:
                try:
                    for sample in shards.samples(shard):
                        if sample.key in wanted:
                            image = next(
                                (sample.members[e] for e in IMAGE_EXTENSIONS if e in sample.members), None
                            )
                            if image is not None:
                                found[sample.key] = image
                        if wanted <= found.keys():
                            return
                except ShardReadError as exc:
                    log.warning(f"retrieval picture: {exc}")
        finally:
            shards.close()

    def fetch(label: int, key: str) -> Any:
        nonlocal scanned
        if not scanned:
            scanned = True
            scan()
        data = found.get(key)
        return None if data is None else decode_thumbnail(data, key, max_pixels)

    fetch.want = wanted.update  # type: ignore[attr-defined]
    return fetch


def draw_search_grid(
    queries: Sequence[str | os.PathLike[str]],
    results: Sequence[Sequence[Any]],
    source: Mapping[str, Any],
    path: str | os.PathLike[str],
    layout: GridLayout | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    cache_dir: str | os.PathLike[str] | ShardCache | None = None,
) -> Path:
    """Draw each query file and its hits (objects with ``key``, ``label``, ``score``, best first) into
    ``path``, the hits read from the export's ``source`` (frames: see the module docstring); every image within
    ``max_pixels`` (the searcher's limit), a URL's shards kept in the node-local ``cache_dir``."""
    fetch, close = export_images(source, max_pixels, cache_dir)
    want = getattr(fetch, "want", None)
    if want is not None:
        want({hit.key for hits in results for hit in hits})
    try:
        query_cells = [Cell(_read_query(q, max_pixels), None, Path(q).name) for q in queries]
        rows = []
        for hits in results:
            top = hits[0].label if hits and hits[0].label >= 0 else None
            rows.append(
                [
                    Cell(
                        fetch(hit.label, hit.key),
                        None if top is None or hit.label < 0 or i == 0 else hit.label == top,
                        f"{hit.score:.3f}",
                    )
                    for i, hit in enumerate(hits)
                ]
            )
        return save_png(draw_grid(query_cells, [rows], layout), path)
    finally:
        close()


def _read_query(path: str | os.PathLike[str], max_pixels: int) -> Any:
    try:
        return decode_thumbnail(Path(path).read_bytes(), str(path), max_pixels)
    except OSError as exc:
        log.warning(f"retrieval picture: cannot read {path}: {exc}")
        return None
