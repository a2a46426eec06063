"""What the retrieval picture shows, as a record: sampled queries and their top-k, by sample key.

An evaluation samples ``eval.grid_queries`` queries of its test split with ``eval.grid_seed`` (not the training
seed: runs that differ in their seed still show the same queries, so ``ddp-rank compare --grid`` can put them
side by side), finds each one's ``eval.grid_k`` nearest neighbours with the protocol's own query / database
roles, and records keys, classes and scores in ``retrieval.json`` beside the results, with the user's names of
each sample (its class name from the manifest, its source file from its json; ``""`` where the shards have
none). The picture
(``ddp_rank.eval.retrieval_grid``) is drawn from that record, its thumbnails read back from the shards by key,
so a record drawn again, or two runs' records drawn together, give the same picture.

Who queries whom: In-Shop's ``query`` images search its ``gallery``; every other protocol (SOP, VehicleID,
verification, identification) shows each sampled image against all the other test images (VehicleID's random
one-image galleries would show a different picture per draw). Only queries with at least one other image of
their class are sampled (the metrics leave the others out too). The sample is a prefix of one seeded
permutation, so 8 queries are the first 8 of the 16 a larger picture shows.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.data.features.records import feature_dim
from ddp_rank.data.format.manifest import Manifest, is_url
from ddp_rank.data.format.sample_names import class_name, sample_source
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS
from ddp_rank.data.reading.reader import ClassReader, ClassReadError
from ddp_rank.data.reading.shard_cache import open_cache
from ddp_rank.data.reading.transforms import decode_image
from ddp_rank.eval.protocols import EmbeddedSet, subset_mask
from ddp_rank.eval.retrieval import ExactSearch
from ddp_rank.eval.retrieval_captions import RECORD_LEGEND, SampleName, neighbour_caption, query_caption
from ddp_rank.eval.retrieval_grid import Cell, GridLayout, draw_grid, save_png
from ddp_rank.eval.runner import EvalSettings, key_index

log = logging.getLogger(__name__)

__all__ = [
    "GRID_FILE",
    "RECORD_FILE",
    "ImageFetch",
    "Neighbour",
    "QueryRow",
    "RecordError",
    "RetrievalPicture",
    "RetrievalRecord",
    "ShardImages",
    "ShownSample",
    "decode_thumbnail",
    "draw_records",
    "eval_picture_file",
    "nearest_rows",
    "read_records",
    "record_cells",
    "record_from_embedded",
    "sample_query_rows",
    "with_names",
    "write_record",
]

GRID_FILE = "retrieval.png"
RECORD_FILE = "retrieval.json"

ImageFetch = Callable[[int, str], "Any"]
"""``fetch(label, key)`` -> a PIL image, or None when it cannot be read."""
Shown = TypeVar("Shown", bound="ShownSample")


class RecordError(ValueError):
    """A ``retrieval.json`` that cannot be drawn (damaged, or other queries than the runs beside it)."""


@dataclass(frozen=True)
class ShownSample:
    """A sample the picture shows, by its key and class id, with the names its user knows it by."""

    key: str
    label: int
    name: str = ""
    """The class name the manifest gives ``label`` (``""``: none known)."""
    source: str = ""
    """The file the sample was built from, as its json records it (``""``: none recorded)."""


@dataclass(frozen=True, kw_only=True)
class Neighbour(ShownSample):
    """A retrieved sample and its similarity to the query."""

    score: float


@dataclass(frozen=True, kw_only=True)
class QueryRow(ShownSample):
    """A sampled query and what it retrieved, nearest first."""

    neighbours: tuple[Neighbour, ...]


@dataclass(frozen=True)
class RetrievalRecord:
    """The queries of one picture: where their images are (``shards``, ``split``) and what each one retrieved."""

    shards: str
    split: str
    protocol: str
    seed: int
    queries: tuple[QueryRow, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any, origin: str) -> RetrievalRecord:
        """Parse one entry of a ``retrieval.json``; a missing or mistyped field is refused by name."""
        try:
            queries = tuple(
                QueryRow(
                    *_shown(q),
                    neighbours=tuple(Neighbour(*_shown(n), score=float(n["score"])) for n in q["neighbours"]),
                )
                for q in data["queries"]
            )
            return cls(
                str(data["shards"]), str(data["split"]), str(data["protocol"]), int(data["seed"]), queries
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(
                f"{origin}: not a retrieval record ({type(exc).__name__}: {exc}); evaluate the run again to "
                "rewrite it"
            ) from exc


def _shown(entry: Mapping[str, Any]) -> tuple[str, int, str, str]:
    """(key, label, name, source) of a record's entry: names ``""`` in a record written before they were kept."""
    return (
        str(entry["key"]),
        int(entry["label"]),
        str(entry.get("name") or ""),
        str(entry.get("source") or ""),
    )


# ---------------------------------------------------------------------------------------------- sampling
def sample_query_rows(
    data: EmbeddedSet, protocol: str, count: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(query rows, database rows) of the picture: ``count`` queries drawn with ``seed`` among those with a
    positive in the database (see the module docstring for the roles)."""
    labels = data.labels.cpu().numpy()
    if protocol == "inshop":
        queries = np.flatnonzero(subset_mask(data, "query").cpu().numpy())
        database = np.flatnonzero(subset_mask(data, "gallery").cpu().numpy())
        candidates = queries[np.isin(labels[queries], labels[database])]
    else:
        database = np.arange(len(labels))
        _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
        candidates = database[counts[inverse] > 1]
    order = np.random.default_rng(seed).permutation(len(candidates))
    return candidates[order[:count]], database


def nearest_rows(
    data: EmbeddedSet,
    queries: np.ndarray,
    database: np.ndarray,
    k: int,
    device: torch.device | str | None = None,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(rows into ``data``, scores), one array of at most ``k`` per query: the ``k`` nearest each query's ``k`` nearest database items, itself left out."""
    search = ExactSearch(data.embeddings[torch.from_numpy(database)], "torch", device)
    scores, idx = search.search(data.embeddings[torch.from_numpy(queries)], k + 1)
    rows = database[idx.numpy()]
    keep = rows != queries[:, None]  # the query itself, when it is in the database
    return [r[m][:k] for r, m in zip(rows, keep)], [s[m][:k] for s, m in zip(scores.numpy(), keep)]


# ---------------------------------------------------------------------------------------------- images
class ShardImages:
    """Images of one split read back by (class, key): one whole-class read per class, kept for the picture, with
    each sample's names (:meth:`names`)."""

    def __init__(
        self,
        manifest: Manifest,
        split: str,
        cache_dir: Any = None,
        max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ) -> None:
        self.reader = ClassReader(manifest, split, cache_dir=cache_dir)
        self.max_pixels = max_pixels  # the user's data.max_image_pixels, as in training
        self._classes: dict[int, dict[str, bytes]] = {}
        self._meta: dict[int, dict[str, bytes | None]] = {}

    def samples(self, label: int) -> dict[str, bytes]:
        """Key -> image bytes of class ``label`` (empty when it cannot be read)."""
        if label not in self._classes:
            try:
                read = self.reader.read(label) if label in self.reader.where else []
            except ClassReadError as exc:
                log.warning(f"retrieval picture: {exc}; its images are drawn blank")
                read = []
            self._classes[label] = {s.key: s.image for s in read}
            self._meta[label] = {s.key: s.meta for s in read}
        return self._classes[label]

    def names(self, label: int, key: str) -> SampleName:
        """The class name the manifest gives ``label`` and the source file sample ``key``'s json records."""
        self.samples(label)
        return SampleName(
            class_name(self.reader.manifest.classes, label), sample_source(self._meta[label].get(key))
        )

    def __call__(self, label: int, key: str) -> Any:
        data = self.samples(label).get(key)
        return None if data is None else decode_thumbnail(data, key, self.max_pixels)

    def close(self) -> None:
        self.reader.close()


def decode_thumbnail(data: bytes, key: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """The image of ``data`` for a thumbnail (decoded at a reduced scale where the format allows), or None with
    a warning naming ``key`` when it cannot be decoded."""
    try:
        return decode_image(data, 128, name=key, max_pixels=max_pixels)
    except Exception as exc:  # any decoder failure: a blank cell, never a failed evaluation
        log.warning(f"retrieval picture: cannot decode {key}: {type(exc).__name__}: {exc}")
        return None


# ---------------------------------------------------------------------------------------------- records
def record_from_embedded(
    data: EmbeddedSet,
    images: ShardImages,
    *,
    shards: str,
    split: str,
    protocol: str,
    count: int,
    k: int,
    seed: int,
    device: torch.device | str | None = None,
) -> RetrievalRecord | None:
    """The record of a gathered test split (its rows carry ``index``, the hash of each sample key); the keys
    are found by reading the classes of the rows shown. None when no query can be sampled."""
    if data.index is None:
        raise ValueError("the embedded set carries no sample index: embed it with ddp_rank.eval.runner")
    queries, database = sample_query_rows(data, protocol, count, seed)
    if len(queries) == 0 or len(database) < 2:
        return None
    rows, scores = nearest_rows(data, queries, database, k, device)
    labels, index = data.labels.cpu().numpy(), data.index.cpu().numpy()
    keys_by_class: dict[int, dict[int, str]] = {}

    def key_of(row: int) -> str:
        label = int(labels[row])
        if label not in keys_by_class:
            keys_by_class[label] = {key_index(key): key for key in images.samples(label)}
        return keys_by_class[label].get(int(index[row]), f"<unread sample of class {label}>")

    def shown(row: int) -> tuple[str, int, str, str]:
        key, label = key_of(row), int(labels[row])
        names = images.names(label, key)
        return key, label, names.name, names.source

    queries_out = []
    for q, row, score in zip(queries, rows, scores):
        neighbours = tuple(Neighbour(*shown(int(r)), score=round(float(s), 6)) for r, s in zip(row, score))
        queries_out.append(QueryRow(*shown(int(q)), neighbours=neighbours))
    return RetrievalRecord(shards, split, protocol, int(seed), tuple(queries_out))


def write_record(record: RetrievalRecord, name: str, directory: str | os.PathLike[str]) -> Path:
    """Add ``record`` under ``name`` to ``directory/retrieval.json`` (entries in the order written)."""
    path = Path(directory) / RECORD_FILE
    try:
        saved = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        saved = {}
    saved = saved if isinstance(saved, dict) else {}
    saved.pop(name, None)  # re-evaluated: the entry moves to the end (the latest)
    saved[name] = record.to_json()
    atomic_write_text(path, json.dumps(saved, indent=1) + "\n")
    return path


def read_records(path: str | os.PathLike[str]) -> dict[str, RetrievalRecord]:
    """Every entry of a ``retrieval.json`` by name, in the order written."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RecordError(f"{path}: unreadable ({exc}); evaluate the run again to rewrite it") from exc
    if not isinstance(saved, dict):
        raise RecordError(f"{path}: not a retrieval record (expected an object of named entries)")
    return {str(name): RetrievalRecord.from_json(entry, f"{path} [{name}]") for name, entry in saved.items()}


def record_cells(
    records: Sequence[RetrievalRecord], fetchers: Sequence[ImageFetch]
) -> tuple[list[Cell], list[list[list[Cell]]]]:
    """(query cells, one block of neighbour cells per record) for the queries every record shows, in the first
    record's order; ``fetchers[i]`` reads record i's images. Captions: a query's class name and file, each
    neighbour's score and class name (the ids where the record has no name)."""
    shown = [q.key for q in records[0].queries]
    by_key = [{q.key: q for q in r.queries} for r in records]
    common = [key for key in shown if all(key in rows for rows in by_key)]
    if not common:
        raise RecordError(
            "the records show no query in common (another split, or another eval.grid_seed): evaluate the runs "
            "on the same split with the same eval.grid_seed"
        )
    first = by_key[0]
    queries = [
        Cell(fetchers[0](q.label, key), None, query_caption(q.name, q.label, q.source, key))
        for key, q in ((key, first[key]) for key in common)
    ]
    blocks = [
        [
            [
                Cell(
                    fetch(n.label, n.key),
                    n.label == rows[key].label,
                    neighbour_caption(n.score, n.name, n.label),
                )
                for n in rows[key].neighbours
            ]
            for key in common
        ]
        for rows, fetch in zip(by_key, fetchers)
    ]
    return queries, blocks


def draw_records(
    records: Sequence[RetrievalRecord],
    fetchers: Sequence[ImageFetch],
    path: str | os.PathLike[str],
    layout: GridLayout | None = None,
) -> tuple[Path, int]:
    """Draw one result block per record, side by side, for the queries every record shows (in the first
    record's order), with the legend under them; ``fetchers[i]`` reads record i's images. Returns (the PNG, the
    queries drawn)."""
    queries, blocks = record_cells(records, fetchers)
    return save_png(draw_grid(queries, blocks, layout, RECORD_LEGEND), path), len(queries)


def eval_picture_file(results: str | os.PathLike[str], label: str) -> str:
    """The picture ``ddp-rank eval`` draws beside its results JSON, named after that JSON and the row evaluated
    (``eval-retrieval-resnet18-trained-step-00000100.png``), so it never replaces a training run's
    ``retrieval.png`` nor another evaluation's picture."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", label).strip("-.") or "model"
    return f"{Path(results).stem}-retrieval-{slug}.png"


def with_names(record: RetrievalRecord, names: Callable[[int, str], SampleName]) -> RetrievalRecord:
    """``record`` with the names a record written before they were kept lacks, from ``names(label, key)``
    (e.g. :meth:`ShardImages.names`); the names it has are kept."""

    def named(row: Shown) -> Shown:
        if row.name:
            return row
        found = names(row.label, row.key)
        return replace(row, name=found.name, source=row.source or found.source)

    queries = tuple(
        replace(named(q), neighbours=tuple(named(n) for n in q.neighbours)) for q in record.queries
    )
    return replace(record, queries=queries)


def shard_images_for(record: RetrievalRecord) -> ShardImages | None:
    """A reader of the record's split, or None for feature shards, which hold no image."""
    manifest = Manifest.load(record.shards)
    if feature_dim(manifest) is not None:
        return None
    return ShardImages(manifest, record.split)


def last_record(saved: Mapping[str, RetrievalRecord]) -> RetrievalRecord | None:
    """The latest entry (the last written) of a run's records."""
    return list(saved.values())[-1] if saved else None


class RetrievalPicture:
    """The retrieval picture of an evaluation: pass :meth:`capture` as ``evaluate_model(on_embedded=...)``, then
    :meth:`write` on rank 0 draws ``retrieval.png`` (a training run's; ``ddp-rank eval`` names its own:
    :func:`eval_picture_file`) and adds the record to ``retrieval.json``.

    VehicleID recipe shards embed one split per list: the last (the largest list) is drawn. Feature shards hold
    no image: no picture, said once in the log.
    """

    def __init__(self, settings: EvalSettings, is_main: bool, manifest: Manifest | None = None) -> None:
        self.settings = settings
        self.enabled = is_main and settings.eval.grid_queries > 0
        self.manifest = manifest
        self._captured: tuple[str, EmbeddedSet] | None = None
        self._said_no_images = False

    def capture(self, split: str, data: EmbeddedSet) -> None:
        if self.enabled:
            self._captured = (split, data)

    def write(
        self, name: str, directory: str | os.PathLike[str], device: Any = None, file: str = GRID_FILE
    ) -> Path | None:
        """Draw the captured split into ``directory/file`` (the record under ``name`` in ``retrieval.json``);
        None when there is nothing to draw."""
        captured, self._captured = self._captured, None
        if captured is None:
            return None
        split, embedded = captured
        settings, data = self.settings, self.settings.data
        manifest = self.manifest if self.manifest is not None else Manifest.load(data.shards)
        if feature_dim(manifest) is not None:
            if not self._said_no_images:
                log.info("no retrieval picture: the test shards hold feature vectors, not images")
                self._said_no_images = True
            return None
        cache = open_cache(data.cache_dir, data.cache_max_gb)
        images = ShardImages(manifest, split, cache, data.max_image_pixels)
        try:
            record = record_from_embedded(
                embedded,
                images,
                shards=_absolute(data.shards),
                split=split,
                protocol=settings.eval.protocol,
                count=settings.eval.grid_queries,
                k=settings.eval.grid_k,
                seed=settings.eval.grid_seed,
                device=device,
            )
            if record is None:
                log.info(f"no retrieval picture: no query of split '{split}' has another image of its class")
                return None
            write_record(record, name, directory)
            path, _ = draw_records([record], [images], Path(directory) / file)
            return path
        finally:
            images.close()


def _absolute(shards: str) -> str:
    """A local shard directory as an absolute path (``compare --grid`` may run from another directory)."""
    return shards if is_url(shards) else str(Path(shards).resolve())
