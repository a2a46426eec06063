"""``ddp-rank shards index``: a ddp_rank manifest for WebDataset shards made by other tools, without rewriting them.

Shards written by img2dataset, ``wds.ShardWriter`` or a script of one's own are plain tars of samples
(``<key>.jpg|jpeg|png|webp`` plus ``.cls`` / ``.json`` / ``.txt`` members). Indexing walks each tar once (Python's
tarfile: every dialect, pax headers included) and records, per class, its byte spans: each run of adjacent
samples of the class is one span (from the first header of its first sample to the end of its last member),
with the span's digest. Any layout indexes: a class contiguous in one shard (ddp_rank's own layout) is one span;
shuffled samples, a class cut across tars by ``maxcount``, interleaved classes give a class several spans, read
with one request each (``ddp-rank shards info`` reports how many; ``ddp-rank shards reshard`` rewrites such shards
into the contiguous layout when requests would bound remote reads). The class of a sample comes from its ``.cls``
member, another text member or a json field (``--class-field NAME``: the text of the sample's ``.NAME`` member,
``--class-field txt`` for a class written as ``.txt``, else its json field NAME) or its key's prefix
(``--class-from-key SEP``: the key up to its last SEP, ``n01440764_10026`` -> ``n01440764``); its category from a
json field or text member (``--category-field``) or a mapping file (class -> category CSV). A ``.txt`` member is
not taken as the class unless named: img2dataset writes captions there. A shard whose classes have several
categories has no category of its own (``null``).

The source may name its shards itself: a brace pattern or a glob (``DIR/data-{000000..000003}.tar``, a URL
``https://host/d/train-{000..099}.tar``) or one tar file is split by ``split_source`` into the directory and the
pattern of a ``train`` split; a pattern that names a missing file is refused naming the first one. Compressed
shards (``.tar.gz``, ``.tgz``, ``.tar.bz2``, ``.tar.xz``, ``.tar.zst``; told by their magic bytes) are refused with
the compression named: they cannot be read by byte range, and ``shards reshard`` converts them (``compressed``).

The shards may sit behind a URL (then name them with brace ranges, ``train-{000..099}.tar``: a URL cannot be
listed); the manifest, written with ``--out DIR``, then points at that URL (``shards_root``) and training reads
the shards from there with ``data.shards=DIR``. A manifest written with ``--out`` away from a local shard
directory points at that directory the same way (its absolute path).

A damaged tar (a corrupt header, a file cut short, an empty file, a json member that does not parse) is refused
with its name: indexing never records part of a shard. Samples without an image member are left out (counted).

``--upgrade`` turns a version-1 ddp_rank manifest into the current one in place, keeping its class ids.
"""

from __future__ import annotations

import csv
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_rank.data.building.listing import natural_key
from ddp_rank.data.building.shard_sources import ShardIndexError, find_splits, source_splits, split_source
from ddp_rank.data.format.class_leaks import RECORD_FIX, ClassLeakError, check_reason, manifest_leak
from ddp_rank.data.format.compressed import CompressedShardError, sniff
from ddp_rank.data.format.manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    IMAGE_EXTENSIONS,
    MANIFEST_NAME,
    ClassInfo,
    ClassSpan,
    Manifest,
    ShardInfo,
    SplitInfo,
    is_url,
    join_location,
    sha256_file,
    span_digest,
)
from ddp_rank.data.format.tar_scan import end_of_archive_problem, sample_key

__all__ = [
    "IndexOptions",
    "IndexReport",
    "ShardIndexError",
    "find_splits",
    "index_shards",
    "read_category_map",
    "source_splits",
    "split_source",
    "upgrade_manifest",
]

_BLOCK = 512


@dataclass
class _Sample:
    key: str
    start: int
    end: int
    image: bool = False
    texts: dict[str, str] = field(default_factory=dict)
    """The text of the members that may hold the class or category (extension -> stripped text)."""
    meta: dict[str, Any] | None = None
    extensions: set[str] = field(default_factory=set)


@dataclass
class _Run:
    """Consecutive samples of one class in one shard."""

    cls: str
    category: str | None
    start: int
    end: int
    count: int = 0
    first_key: str = ""


@dataclass
class IndexOptions:
    """Where the class and the category of a sample come from."""

    class_field: str | None = None
    """Where the class is: the text member of that extension (``txt``: the sample's ``.txt``), else the json field
    of that name; None: the ``.cls`` member (then the json's ``class`` field, if any)."""
    category_field: str | None = "category"
    """Where the category is (a text member's extension, else a json field; missing or None: unlabelled)."""
    category_map: Mapping[str, str] = field(default_factory=dict)
    """class -> category, from a CSV with columns ``class,category`` (wins over the json field)."""
    class_from_key: str | None = None
    """Separator: the class is the sample key up to its last occurrence (``n01440764_10026`` with ``_``);
    None: the class comes from the members (``class_field``)."""

    def __post_init__(self) -> None:
        for flag, value in (("--class-field", self.class_field), ("--category-field", self.category_field)):
            if value is not None and (value.lower() in IMAGE_EXTENSIONS or value.lower() == "json"):
                raise ShardIndexError(
                    f"{flag} {value}: name a json field or the extension of a text member (txt, cls, ...), not "
                    "the image or the json member itself"
                )

    def text_members(self) -> frozenset[str]:
        """Extensions of the members read as text: ``.cls`` and the ones the fields name."""
        named = (f.lower() for f in (self.class_field, self.category_field) if f is not None)
        return frozenset({"cls", *named})


def read_category_map(path: str | os.PathLike[str]) -> dict[str, str]:
    # utf-8-sig: Excel's "CSV UTF-8" starts the file with a byte-order mark.
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"class", "category"} <= set(reader.fieldnames):
            raise ShardIndexError(f"{path}: the mapping needs a header with columns class,category")
        return {row["class"].strip(): row["category"].strip() for row in reader}


_REDO = "re-create the shard from its source, or drop it from the split (--split NAME=PATTERN)"


def _samples(path: str, name: str, texts: frozenset[str] = frozenset({"cls"})) -> Iterator[_Sample]:
    """The samples of a tar in stored order with their byte extents (header of the first member to the end
    of the last member's padded data), with the text of their members of the extensions ``texts`` and their
    json. Members of one sample must be adjacent, as WebDataset requires. Raises ``ShardIndexError`` naming the
    shard (``name``) when the tar is damaged or ends early, ``CompressedShardError`` when it is compressed."""
    current: _Sample | None = None
    if os.path.getsize(path) == 0:
        raise ShardIndexError(f"{name}: empty file (0 bytes; an interrupted copy?): {_REDO}")
    with open(path, "rb") as f:
        compression = sniff(f)
        if compression is not None:
            raise CompressedShardError(
                f"{name} is a {compression}-compressed tar, which cannot be read by byte range", compression
            )
        try:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    key, ext = sample_key(info.name)
                    end = info.offset_data + -(-info.size // _BLOCK) * _BLOCK
                    if current is None or current.key != key:
                        if current is not None:
                            yield current
                        current = _Sample(key, info.offset, end)
                    current.end = end
                    current.extensions.add(ext)
                    if ext in IMAGE_EXTENSIONS:
                        current.image = True
                    elif (ext in texts or ext == "json") and info.size <= 1 << 20:
                        _read_label(tar, info, current, name, ext)
                stopped = tar.offset
        except (tarfile.TarError, EOFError) as exc:
            near = f" near sample {current.key}" if current is not None else ""
            raise ShardIndexError(
                f"{name}: unreadable tar{near}, cut short or corrupt ({exc}): {_REDO}"
            ) from exc
        problem = end_of_archive_problem(f, stopped)
        if problem is not None:
            raise ShardIndexError(f"{name}: {problem}: {_REDO}")
    if current is not None:
        yield current


def _read_label(tar: tarfile.TarFile, info: tarfile.TarInfo, sample: _Sample, name: str, ext: str) -> None:
    """Fill ``sample.texts[ext]`` or ``sample.meta`` from a text or ``.json`` member."""
    member = tar.extractfile(info)
    raw = member.read() if member is not None else b""
    if len(raw) != info.size:
        raise ShardIndexError(f"{name}: sample {sample.key}: {info.name} is cut short: {_REDO}")
    try:
        if ext != "json":
            sample.texts[ext] = raw.decode("utf-8").strip()
        else:
            sample.meta = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        kind = "UTF-8 text" if ext != "json" else "valid JSON"
        raise ShardIndexError(
            f"{name}: sample {sample.key}: {info.name} is not {kind} ({exc}); fix or remove that sample, or "
            f"{_REDO}"
        ) from exc


def _field(sample: _Sample, name: str) -> Any:
    """The value ``name`` names in a sample: its text member of that extension, else its json field (or None)."""
    if name.lower() in sample.texts:
        return sample.texts[name.lower()]
    return (sample.meta if isinstance(sample.meta, dict) else {}).get(name)


def _class_of(sample: _Sample, options: IndexOptions, where: str) -> tuple[str, str | None]:
    meta = sample.meta if isinstance(sample.meta, dict) else {}
    if options.class_from_key is not None:
        name = sample.key.rsplit("/", 1)[-1] if options.class_from_key != "/" else sample.key
        cls, sep, _ = name.rpartition(options.class_from_key)
        if not sep or not cls:
            raise ShardIndexError(
                f"{where}: the key of sample {sample.key} has no {options.class_from_key!r} before its "
                "number; name the separator of class and number in the keys with --class-from-key, or take "
                "the class from the .cls member or a json field (--class-field)"
            )
    elif options.class_field is not None:
        value = _field(sample, options.class_field)
        if value is None:
            raise ShardIndexError(
                f"{where}: sample {sample.key} has no .{options.class_field} member and no json field "
                f"{options.class_field!r}; pick the member or json field that holds the class with --class-field "
                f"(the sample has {_members(sample)}), or take it from the key with --class-from-key SEP"
            )
        cls = str(value)
    elif "cls" in sample.texts:
        cls = sample.texts["cls"]
    elif "class" in meta:
        cls = str(meta["class"])
    else:
        raise ShardIndexError(
            f"{where}: sample {sample.key} has no .cls member and no json 'class' field; name the member or "
            f"json field that holds the class with --class-field (the sample has {_members(sample)}"
            f"{'; --class-field txt reads the .txt member' if 'txt' in sample.extensions else ''}), or take it "
            "from the key with --class-from-key SEP"
        )
    if not cls:
        raise ShardIndexError(
            f"{where}: sample {sample.key} has an empty class; fill it in, or drop that sample from the shard"
        )
    category = options.category_map.get(cls)
    if category is None and options.category_field is not None:
        value = _field(sample, options.category_field)
        category = None if value in (None, "") else str(value)
    return cls, category


def _members(sample: _Sample) -> str:
    """The member extensions and json fields of a sample, for an error message."""
    fields = sorted(sample.meta) if isinstance(sample.meta, dict) else []
    members = ", ".join(f".{e}" for e in sorted(sample.extensions))
    return f"members {members}" + (f" and json fields {', '.join(fields)}" if fields else "")


def _runs(path: str, name: str, options: IndexOptions) -> tuple[list[_Run], int, int]:
    """The class runs of one shard, its size and the number of samples without an image (left out)."""
    runs: list[_Run] = []
    skipped = 0
    reach = -1  # end of the image-less samples right after the last run: they do not break it
    for sample in _samples(path, name, options.text_members()):
        if not sample.image:
            skipped += 1
            if runs and sample.start in (runs[-1].end, reach):
                reach = sample.end
            continue
        cls, category = _class_of(sample, options, name)
        last = runs[-1] if runs else None
        if last and (last.category, last.cls) == (category, cls) and sample.start in (last.end, reach):
            last.end, last.count = sample.end, last.count + 1
        else:
            runs.append(_Run(cls, category, sample.start, sample.end, 1, sample.key))
        reach = -1
    return runs, os.path.getsize(path), skipped


def _digests(path: str, runs: Sequence[_Run]) -> list[str]:
    """The span digest of every class run of a shard, with the file opened once."""
    with open(path, "rb") as f:
        out = []
        for run in runs:
            f.seek(run.start)
            out.append(span_digest(f.read(run.end - run.start)))
        return out


@contextmanager
def _local_copy(location: str) -> Iterator[str]:
    """A local path to read a shard from: the file itself, or a temporary download of a URL (indexing reads
    every byte of a shard anyway: its sha256 and every class's digest)."""
    if not is_url(location):
        yield location
        return
    import fsspec

    fs, path = fsspec.core.url_to_fs(location)
    with tempfile.TemporaryDirectory(prefix="ddp_rank-index-") as tmp:
        local = os.path.join(tmp, "shard.tar")
        try:
            fs.get_file(path, local)
        except FileNotFoundError as exc:  # an HTTP 404, a missing object
            raise ShardIndexError(
                f"{location}: no such shard at the URL; fix the pattern (or the range) to name only the shards "
                "there"
            ) from exc
        yield local


@dataclass
class IndexReport:
    manifest: Manifest
    skipped_samples: int = 0
    notes: list[str] = field(default_factory=list)


def index_shards(
    directory: str | os.PathLike[str],
    splits: Mapping[str, Sequence[str]],
    options: IndexOptions,
    out: str | os.PathLike[str] | None = None,
    shared_classes: str | None = None,
) -> IndexReport:
    """Index the shards under ``directory`` (a local directory or a URL; split -> relative paths) into a
    manifest, returned and not saved. ``out`` is where the manifest will be saved (default: ``directory``);
    when that is not the shard directory, the manifest's ``shards_root`` points at the shards (see
    ``_shards_root``), so the manifest can be kept anywhere (``Manifest.save``). A class (as the samples name
    it) of the ``train`` split found in another split is refused with ``ClassLeakError``, unless
    ``shared_classes`` says why (then recorded in the manifest)."""
    shared_classes = check_reason(shared_classes)
    root = os.fspath(directory).rstrip("/") or "/"
    walked: dict[str, list[tuple[str, list[_Run], int, str, list[str]]]] = {}
    skipped = 0
    for split, paths in splits.items():
        walked[split] = []
        for rel in paths:
            with _local_copy(join_location(root, rel)) as local:
                runs, size, lost = _runs(local, rel, options)
                digests = _digests(local, runs)
                walked[split].append((rel, runs, size, sha256_file(local), digests))
            skipped += lost
    every_run = [r for shards in walked.values() for _, runs, _, _, _ in shards for r in runs]
    categories = sorted({r.category for r in every_run if r.category is not None}, key=natural_key)
    category_id = {c: i for i, c in enumerate(categories)}
    names = sorted(
        {(r.category, r.cls) for r in every_run},
        key=lambda cc: (cc[0] is None, natural_key(cc[0] or ""), natural_key(cc[1])),
    )
    class_id = {cc: i for i, cc in enumerate(names)}
    classes = tuple(ClassInfo(i, cls, category_id.get(cat or "")) for (cat, cls), i in class_id.items())
    split_infos = {}
    for split, shards in walked.items():
        infos: list[ShardInfo] = []
        counts: dict[int, int] = {}
        for rel, runs, size, sha256, digests in shards:
            spans = tuple(
                ClassSpan(class_id[(r.category, r.cls)], r.count, r.start, r.end - r.start, digest)
                for r, digest in zip(runs, digests)
            )
            cats = {category_id.get(r.category or "") for r in runs}
            infos.append(
                ShardInfo(
                    rel,
                    cats.pop() if len(cats) == 1 else None,
                    spans,
                    sum(x.count for x in spans),
                    size,
                    sha256,
                )
            )
            for x in spans:  # a class of several spans counts all of them
                counts[x.id] = counts.get(x.id, 0) + x.count
        split_infos[split] = SplitInfo(split, counts, tuple(infos))
    saved_in = root if out is None else os.fspath(out)
    manifest = Manifest(
        tuple(categories),
        classes,
        split_infos,
        build={"indexed": True},
        root=None if is_url(saved_in) else saved_in,
        shards_root=_shards_root(root, out),
        shared_classes=shared_classes,
    )
    problem = manifest_leak(manifest)
    if problem is not None:
        raise ClassLeakError(f"the shards of {root}", problem, _RESPLIT)
    return IndexReport(manifest, skipped)


_RESPLIT = (
    "index splits whose shards hold classes of their own (--split NAME=PATTERN), and check that the class "
    "option (--class-field, --class-from-key) names the class, not a label that restarts in each split; or, "
    f"{RECORD_FIX}"
)


def _shards_root(root: str, out: str | os.PathLike[str] | None) -> str | None:
    """What a manifest saved in ``out`` records as its shards' location: nothing when they sit beside it, the
    URL of shards behind a URL, else the shard directory's absolute path."""
    if is_url(root):
        return root
    if out is None or Path(out).resolve() == Path(root).resolve():
        return None
    return str(Path(root).resolve())


def upgrade_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Add class byte ranges to a version-1 ddp_rank manifest, keeping its classes, splits and build record."""
    root = Path(directory)
    data = json.loads((root / MANIFEST_NAME).read_text(encoding="utf-8"))
    if data.get("format") != FORMAT_NAME or data.get("version") == FORMAT_VERSION:
        raise ShardIndexError(f"{root}: not a version-1 ddp_rank manifest; nothing to upgrade")
    for raw in data["splits"].values():
        for shard in raw["shards"]:
            path = str(root / shard["path"])
            runs, _, _ = _runs(path, shard["path"], IndexOptions(class_field=None, category_field=None))
            ids = [(int(r.cls), r.count) for r in runs]
            if ids != [(int(c), int(n)) for c, n in shard["classes"]]:
                raise ShardIndexError(
                    f"{shard['path']}: its classes differ from the manifest's; rebuild the shards"
                )
            shard["classes"] = [
                [int(r.cls), r.count, r.start, r.end - r.start, digest]
                for r, digest in zip(runs, _digests(path, runs))
            ]
    data["version"] = FORMAT_VERSION
    manifest = Manifest.from_json(data, root=root)
    manifest.save(root)
    return manifest
