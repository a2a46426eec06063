"""The picture of ``ddp-rank search --grid``: ad-hoc query images and their hits in an exported collection.

The hits' thumbnails are read back from what the export recorded as its source: a split of shards (by class),
an image folder (the key is the file's relative path) or WebDataset shards at a URL (read in order until every
key shown is found), each through the data layer's checked reader. An ad-hoc query has no class, so the frames say whether each hit shares the class of the
query's top-1 (which is framed grey: the reference): green the same class, red another; hits without a class (an
image folder export) are all framed grey. A legend under the rows says so.

The same readers give each hit's names (:func:`hit_names`): for a split, the class name from its manifest and the
source file from the sample's json; for an image folder, the file under the folder; for shards at a URL, what the
samples' json say once the picture's scan has read them (the ids the index holds otherwise).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ddp_rank.data.format.manifest import IMAGE_EXTENSIONS, Manifest, confined_join
from ddp_rank.data.format.sample_names import sample_field, sample_source
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS
from ddp_rank.data.reading.named_shards import NamedShards, ShardReadError
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.eval.retrieval_captions import SampleName, neighbour_caption, search_legend
from ddp_rank.eval.retrieval_grid import Cell, GridLayout, draw_grid, save_png
from ddp_rank.eval.retrieval_record import ImageFetch, RecordError, ShardImages, decode_thumbnail

log = logging.getLogger(__name__)

ImageNames = Callable[[int, str], SampleName]

__all__ = ["draw_search_grid", "export_images", "folder_images", "hit_names", "search_cells", "url_images"]


def folder_images(root: str | os.PathLike[str], max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> ImageFetch:
    """``fetch`` for an image folder export: the key is the file's path relative to ``root`` (kept inside it)."""

    def fetch(label: int, key: str) -> Any:
        try:
            path = confined_join(os.fspath(root), key)
            return decode_thumbnail(Path(path).read_bytes(), key, max_pixels)
        except (OSError, ValueError) as exc:
            log.warning(f"retrieval picture: cannot read {key} under {root}: {exc}")
            return None

    fetch.names = lambda label, key: SampleName("", os.path.join(os.fspath(root), key))  # type: ignore[attr-defined]
    return fetch


def hit_names(fetch: ImageFetch | None) -> ImageNames:
    """``names(label, key)`` -> the :class:`SampleName` of an item of the export ``fetch`` reads (see the module
    docstring; ``SampleName()`` where the source tells none, or no source could be opened: None)."""
    names = getattr(fetch, "names", None)
    return names if names is not None else lambda label, key: SampleName()


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
    metas: dict[str, bytes | None] = {}
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
                                metas[sample.key] = sample.members.get("json")
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

    def names(label: int, key: str) -> SampleName:
        meta = metas.get(key)  # known once the scan has read the sample, never a scan of its own
        return SampleName(sample_field(meta, "class"), sample_source(meta))

    fetch.want = wanted.update  # type: ignore[attr-defined]
    fetch.names = names  # type: ignore[attr-defined]
    return fetch


def search_cells(
    queries: Sequence[str | os.PathLike[str]],
    results: Sequence[Sequence[Any]],
    fetch: ImageFetch,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
) -> tuple[list[Cell], list[list[Cell]]]:
    """(query cells, one row of hit cells per query): the hits (objects with ``key``, ``label``, ``score``, best
    first) read with ``fetch``, framed as the module docstring says, captioned with their score and class name
    (their file where they have no class)."""
    want = getattr(fetch, "want", None)
    if want is not None:
        want({hit.key for hits in results for hit in hits})
    names = hit_names(fetch)
    query_cells = [Cell(_read_query(q, max_pixels), None, Path(q).name) for q in queries]
    rows = []
    for hits in results:
        top = hits[0].label if hits and hits[0].label >= 0 else None
        row = []
        for i, hit in enumerate(hits):
            image = fetch(hit.label, hit.key)  # first: a URL's scan reads the names with the images
            named = names(hit.label, hit.key)
            match = None if top is None or hit.label < 0 or i == 0 else hit.label == top
            caption = neighbour_caption(hit.score, named.name, hit.label, named.source, hit.key)
            row.append(Cell(image, match, caption))
        rows.append(row)
    return query_cells, rows


def draw_search_grid(
    queries: Sequence[str | os.PathLike[str]],
    results: Sequence[Sequence[Any]],
    source: Mapping[str, Any] | ImageFetch,
    path: str | os.PathLike[str],
    layout: GridLayout | None = None,
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    cache_dir: str | os.PathLike[str] | ShardCache | None = None,
) -> Path:
    """Draw each query file and its hits into ``path`` with the legend (:func:`search_cells`), the hits read
    from the export's ``source`` (or with a ``fetch`` already opened by :func:`export_images`, left open); every
    image within ``max_pixels`` (the searcher's limit), a URL's shards kept in the node-local ``cache_dir``."""
    if isinstance(source, Mapping):
        fetch, close = export_images(source, max_pixels, cache_dir)
    else:
        fetch, close = source, lambda: None
    try:
        query_cells, rows = search_cells(queries, results, fetch, max_pixels)
        labelled = any(hit.label >= 0 for hits in results for hit in hits)
        return save_png(draw_grid(query_cells, [rows], layout, search_legend(labelled)), path)
    finally:
        close()


def _read_query(path: str | os.PathLike[str], max_pixels: int) -> Any:
    try:
        return decode_thumbnail(Path(path).read_bytes(), str(path), max_pixels)
    except OSError as exc:
        log.warning(f"retrieval picture: cannot read {path}: {exc}")
        return None
