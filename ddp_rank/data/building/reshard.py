"""``ddp-rank shards reshard SRC DST``: rewrite indexed shards of any layout into the project's own layout.

Shards made by other tools and indexed in place (``shards index``) read well, but a class of a shuffled set is
many small spans, one request each (``fragmentation``). Resharding writes the same samples again as
``shards build`` lays them out: per split, one category per shard (categories in id order, unlabelled classes
last), classes in id order and contiguous (one span each), shards cut between classes at a target size
(``max_samples`` / ``max_bytes``; a larger class gets a shard of its own). Class ids, names, categories and
counts stay those of the source manifest, and a class's samples keep the source's order (its spans in manifest
order), so the global plan and every batch are the same on either copy. Each sample is written as ``build`` writes
it: ``c<class id>_<n>.<image ext>``, ``.cls`` (the class id) and ``.json`` (class, category, ``source``: the
source shard and key, and ``subset`` when the source's json had one).

Memory: the source's spans are read in windows of at most ``memory_bytes``, checked against their digests,
parsed and written out before the next window is read (the bytes and their parsed samples: about twice the
setting at most); a span larger than that (a big class of a contiguous source) is streamed member by member
(``span_samples``), its digest checked at its end. Nothing else grows with the dataset but the
manifests. Spans of a URL are read with concurrent requests (``ShardStore``).

Sources without a manifest: shards of any tool, plain or compressed (``.tar.gz`` and kin, which cannot be read by
byte range), named by a directory, a brace pattern or ``--split``, are indexed first with the options of ``shards
index`` (a compressed source decompressed once into ``DST/.reshard/source/``, see ``reshard_source``); the output
is the same plain tars.

Safety and resumption: a shard is written under a temporary name and renamed when complete (``tar_writer``), so
no half shard ever has a final name; each finished shard is then appended to ``DST/.reshard/done.jsonl``. A rerun
after a kill (same SRC and settings, recorded in ``DST/.reshard/plan.json``) keeps the shards listed there that are
still whole and writes the rest; the output is byte for byte what one uninterrupted run writes. At the end the
manifest is written, every shard is verified against it (``verify.verify_shards``) and every class's count against
the source, and ``.reshard/`` is removed.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ddp_rank.atomic_io import atomic_write_text
from ddp_rank.data.building.reshard_source import WORK, has_manifest, indexed_source, source_settings
from ddp_rank.data.building.shard_index import IndexOptions
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.class_leaks import RECORD_FIX, ClassLeakError, check_reason, manifest_leak
from ddp_rank.data.format.manifest import (
    MANIFEST_NAME,
    ClassSpan,
    Manifest,
    ShardInfo,
    SplitInfo,
    join_location,
    span_digest,
)
from ddp_rank.data.format.tar_scan import SpanSample
from ddp_rank.data.format.tar_writer import shard_writer
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS
from ddp_rank.data.reading.reader import class_spans
from ddp_rank.data.reading.span_samples import SpanReadError, checked_samples, streamed_samples
from ddp_rank.data.reading.storage import ShardStore

STATE_DIR = ".reshard"
"""Folder of DST holding the run's settings and its finished shards while a reshard is under way."""


class ReshardError(ValueError):
    """The reshard cannot go on; the message names the file or setting, the problem and the fix."""


@dataclass(frozen=True)
class ReshardOptions:
    """How to reshard."""

    max_samples: int = 1000
    """Most samples per output shard (a class with more gets a shard of its own)."""
    max_bytes: int = 256 * 2**20
    """Most bytes of source spans per output shard (same exception)."""
    memory_bytes: int = 256 * 2**20
    """Most bytes of source spans held in memory at once (a single larger span is read alone)."""
    decode: bool = False
    """Also decode every image in the final verification (slower)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """The pixel limit (width x height) of that decode (``--max-image-pixels``)."""
    progress: bool = True
    shared_classes: str | None = None
    """Why the splits may share classes (``--shared-classes``): recorded in the output's manifest (in place of
    the source's); None keeps the source's, and a source whose splits share classes without one is refused."""


@dataclass(frozen=True)
class _Planned:
    """One output shard: its path under DST, category and classes (ids in order)."""

    path: str
    category: int | None
    class_ids: tuple[int, ...]


def plan_shards(manifest: Manifest, options: ReshardOptions) -> list[_Planned]:
    """The output shards, a pure function of the source manifest and the options (see the module docstring)."""
    planned: list[_Planned] = []
    for name in sorted(manifest.splits):
        where = class_spans(manifest, name)  # class id -> its spans, for this split
        for category in [*range(len(manifest.categories)), None]:
            ids = sorted(cid for cid in where if manifest.classes[cid].category == category)
            label = "unlabelled" if category is None else f"c{category:04d}"
            chunk: list[int] = []
            count = size = 0
            for cid in ids:
                n = sum(span.count for _, span in where[cid])
                nbytes = sum(span.length for _, span in where[cid])
                if chunk and (count + n > options.max_samples or size + nbytes > options.max_bytes):
                    planned.append(
                        _Planned(f"{name}/{name}-{label}-{len(planned):05d}.tar", category, tuple(chunk))
                    )
                    chunk, count, size = [], 0, 0
                chunk.append(cid)
                count, size = count + n, size + nbytes
            if chunk:
                planned.append(
                    _Planned(f"{name}/{name}-{label}-{len(planned):05d}.tar", category, tuple(chunk))
                )
    return planned


def reshard(
    source: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: ReshardOptions | None = None,
    index: IndexOptions | None = None,
    splits: Sequence[str] = (),
) -> Manifest:
    """Rewrite the shards of ``source`` into ``out``; returns the new manifest (saved in ``out``). ``source`` is a
    directory or URL with ``manifest.json``, or shards without one (a directory, a brace pattern, ``splits``:
    ``NAME=PATTERN``), indexed with ``index`` first and decompressed first when compressed
    (``reshard_source``). Resumes an interrupted run of the same settings (see the module docstring)."""
    options = options or ReshardOptions()
    for name, flag in (
        ("max_samples", "--max-samples"),
        ("max_bytes", "--max-mb"),
        ("memory_bytes", "--memory-mb"),
    ):
        if getattr(options, name) < 1:
            raise ReshardError(f"{flag} ({name}={getattr(options, name)}) is too small: give a positive size")
    dst = Path(out)
    settings: dict[str, Any] = {
        "source": os.fspath(source).rstrip("/") or "/",
        "options": {k: v for k, v in asdict(options).items() if k in ("max_samples", "max_bytes")},
    }
    if has_manifest(source, tuple(splits)):
        if index is not None or splits:
            raise ReshardError(
                f"{source} holds manifest.json, whose classes the reshard keeps: --split and the class and "
                "category options are for shards without one; drop them"
            )
        manifest = _checked_source(Manifest.load(source), source, options.shared_classes)
        settings["source_manifest"] = span_digest(
            json.dumps(manifest.to_json(), sort_keys=True).encode("utf-8")
        )
        done = _start(dst, settings)
    else:
        root, found, recorded = source_settings(source, tuple(splits), index or IndexOptions())
        settings.update(recorded)
        done = _start(dst, settings)
        work = dst / STATE_DIR / WORK
        shared = check_reason(options.shared_classes)
        try:
            manifest = indexed_source(root, found, index or IndexOptions(), work, options.progress, shared)
        except ClassLeakError as exc:  # name the source, not the work folder it was decompressed into
            raise ClassLeakError(f"the shards of {settings['source']}", exc.problem, exc.fix) from exc
    planned = plan_shards(manifest, options)
    store = ShardStore(manifest)
    wheres = {name: class_spans(manifest, name) for name in manifest.splits}
    bar = tqdm(
        total=sum(manifest.split(n).samples for n in manifest.splits),
        unit="img",
        desc="reshard",
        disable=not options.progress,
    )
    written: list[ShardInfo] = []
    try:
        for shard in planned:
            info = done.get(shard.path)
            if info is None or not _whole(dst / shard.path, info):
                info = _write(manifest, wheres[shard.path.split("/", 1)[0]], store, shard, dst, options)
                _record(dst, info)
            written.append(info)
            bar.update(info.samples)
    finally:
        bar.close()
        store.close()
    result = _finish(manifest, dst, written, settings, options)
    shutil.rmtree(dst / STATE_DIR)
    return result


def _checked_source(manifest: Manifest, source: str | os.PathLike[str], reason: str | None) -> Manifest:
    """The source's manifest with ``reason`` recorded when given; refused (``ClassLeakError``) when its splits
    share classes and neither it nor ``reason`` says why."""
    if reason is not None:
        manifest = replace(manifest, shared_classes=check_reason(reason))
    problem = manifest_leak(manifest)
    if problem is not None:
        where = join_location(os.fspath(source), MANIFEST_NAME)
        raise ClassLeakError(where, problem, f"rebuild the source with a class split; or, {RECORD_FIX}")
    return manifest


def _start(dst: Path, settings: dict[str, Any]) -> dict[str, ShardInfo]:
    """Check DST and the settings of a run under way; the shards it finished (path -> entry)."""
    state = dst / STATE_DIR
    plan_file = state / "plan.json"
    if plan_file.is_file():
        recorded = json.loads(plan_file.read_text(encoding="utf-8"))
        if recorded != settings:
            same = all(recorded.get(k) == settings[k] for k in ("source", "options"))
            changed = " (its shards, their index options or its manifest changed since)" if same else ""
            raise ReshardError(
                f"{plan_file}: {dst} holds an unfinished reshard of {recorded.get('source')} with "
                f"{recorded.get('options')}, not of {settings['source']} with {settings['options']}{changed}; "
                "rerun that reshard to finish it, or pick a new DST"
            )
    else:
        if (dst / MANIFEST_NAME).exists():
            raise ReshardError(f"{dst / MANIFEST_NAME} exists: {dst} holds finished shards; pick a new DST")
        if dst.exists() and any(dst.iterdir()):
            raise ReshardError(
                f"{dst} is not empty and holds no reshard under way; pick a new (or empty) DST"
            )
        state.mkdir(parents=True, exist_ok=True)
        atomic_write_text(plan_file, json.dumps(settings, sort_keys=True) + "\n")
    for partial in dst.glob("*/.*.partial"):  # a killed run's shard in progress: never complete
        partial.unlink()
    done: dict[str, ShardInfo] = {}
    journal = state / "done.jsonl"
    if journal.is_file():
        for line in journal.read_text(encoding="utf-8").splitlines():
            try:
                info = _shard_from_json(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue  # the line a kill cut short: that shard is written again
            done[info.path] = info
    return done


def _whole(path: Path, info: ShardInfo) -> bool:
    """Whether a shard a former run finished is still there in full (size; the final verification checks all)."""
    return path.is_file() and path.stat().st_size == info.bytes


def _record(dst: Path, info: ShardInfo) -> None:
    """Append a finished shard to the journal, on disk before the next shard starts."""
    row = {**asdict(info), "classes": [[c.id, c.count, c.offset, c.length, c.digest] for c in info.classes]}
    with open(dst / STATE_DIR / "done.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _shard_from_json(row: dict[str, Any]) -> ShardInfo:
    return ShardInfo(
        path=str(row["path"]),
        category=None if row["category"] is None else int(row["category"]),
        classes=tuple(ClassSpan(int(a), int(b), int(c), int(d), str(e)) for a, b, c, d, e in row["classes"]),
        samples=int(row["samples"]),
        bytes=int(row["bytes"]),
        sha256=str(row["sha256"]),
    )


def _write(
    manifest: Manifest,
    where: dict[int, list[tuple[ShardInfo, ClassSpan]]],
    store: ShardStore,
    shard: _Planned,
    dst: Path,
    options: ReshardOptions,
) -> ShardInfo:
    """Write one output shard from the source's spans (``where``: its split's), read in windows of at most
    ``memory_bytes``."""
    items = [(cid, src, span) for cid in shard.class_ids for src, span in where[cid]]
    path = dst / shard.path
    path.parent.mkdir(parents=True, exist_ok=True)
    numbers = dict.fromkeys(shard.class_ids, 0)
    try:
        return _write_samples(manifest, items, store, shard, path, options, numbers)
    except SpanReadError as exc:  # the shard in progress was dropped (never renamed into place)
        raise ReshardError(str(exc)) from exc


def _write_samples(
    manifest: Manifest,
    items: list[tuple[int, ShardInfo, ClassSpan]],
    store: ShardStore,
    shard: _Planned,
    path: Path,
    options: ReshardOptions,
    numbers: dict[int, int],
) -> ShardInfo:
    """``_write``'s work: the spans ``items`` (class id, source shard, span) read and written in order."""
    with shard_writer(path) as writer:
        for window in _windows(items, options.memory_bytes, lambda item: item[2].length):
            if window[0][2].length > options.memory_bytes:  # one span too large to hold: streamed
                cid, src, span = window[0]
                streamed = [(cid, src, streamed_samples(store, src, span, options.memory_bytes))]
            else:
                results = store.read_many([(src, span.offset, span.length) for _, src, span in window])
                streamed = [
                    (cid, src, iter(checked_samples(src, span, data)))
                    for (cid, src, span), data in zip(window, results)
                ]
            for cid, src, samples in streamed:
                for sample in samples:
                    writer.add(
                        f"c{cid:07d}_{numbers[cid]:05d}",
                        sample.image_ext,
                        sample.image,
                        cid,
                        _meta(manifest, cid, src.path, sample),
                    )
                    numbers[cid] += 1
        nbytes, sha256 = writer.close()
    return ShardInfo(shard.path, shard.category, tuple(writer.spans), writer.samples, nbytes, sha256)


def _windows(items: Sequence[Any], limit: int, size: Callable[[Any], int]) -> Iterator[list[Any]]:
    """Consecutive runs of ``items`` whose sizes add up to at most ``limit`` (an item over it alone)."""
    window: list[Any] = []
    total = 0
    for item in items:
        if window and total + size(item) > limit:
            yield window
            window, total = [], 0
        window.append(item)
        total += size(item)
    if window:
        yield window


def _meta(manifest: Manifest, class_id: int, shard_path: str, sample: SpanSample) -> dict[str, Any]:
    info = manifest.classes[class_id]
    meta: dict[str, Any] = {
        "class": info.name,
        "category": None if info.category is None else manifest.categories[info.category],
        "source": f"{shard_path}:{sample.key}",
    }
    try:
        subset = json.loads(sample.meta.decode("utf-8")).get("subset") if sample.meta else None
    except (ValueError, AttributeError):  # not json, or json that is not an object: nothing to keep
        subset = None
    if isinstance(subset, str) and subset:
        meta["subset"] = subset
    return meta


def _finish(
    source: Manifest, dst: Path, written: list[ShardInfo], settings: dict[str, Any], options: ReshardOptions
) -> Manifest:
    """Save the manifest, verify every shard against it and every class count against the source."""
    splits = {
        name: SplitInfo(
            name,
            dict(split.class_counts),
            tuple(s for s in written if s.path.startswith(f"{name}/")),
        )
        for name, split in source.splits.items()
    }
    build = {"resharded_from": settings["source"], **settings["options"]}
    manifest = Manifest(
        source.categories,
        source.classes,
        splits,
        build=build,
        root=str(dst),
        shared_classes=source.shared_classes,
    )
    for name, split in splits.items():
        counts: dict[int, int] = {}
        for shard in split.shards:
            for span in shard.classes:
                counts[span.id] = counts.get(span.id, 0) + span.count
        if counts != split.class_counts:
            raise ReshardError(
                f"{dst}: split {name} holds other class counts than the source; rerun the reshard"
            )
    manifest.save(dst)
    problems = verify_shards(dst, decode=options.decode, max_pixels=options.max_image_pixels)
    if problems:
        shown = "; ".join(str(p) for p in problems[:5])
        raise ReshardError(
            f"{dst}: the written shards do not verify ({shown}); remove {dst} and reshard again"
        )
    return Manifest.load(dst)
