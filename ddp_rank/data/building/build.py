"""``ddp-rank shards build``: listing -> tar shards per split, one category per shard, plus ``manifest.json``.

Steps: check the records (duplicates, small classes), decide splits by class, number categories and classes in a
fixed order (sorted names, numbers compared as numbers), plan shards (whole classes, contiguous, bounded by count
and bytes), write the shards in parallel, then write the manifest last. Every step is a pure function of the
listing and the options, so the same input gives the same bytes, whatever the worker count.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from PIL import Image
from tqdm import tqdm

from ddp_rank.data.building.build_dir import check_out_dir, remove_stale
from ddp_rank.data.building.listing import (
    TEST_CLASSES,
    ListingError,
    OnBad,
    Record,
    Report,
    TestClasses,
    assign_splits,
    carve_validation,
    check_records,
    natural_key,
)
from ddp_rank.data.format.class_leaks import RECORD_FIX, ClassLeakError, check_reason, class_leak
from ddp_rank.data.format.manifest import ClassInfo, Manifest, ShardInfo, SplitInfo, split_name_problem
from ddp_rank.data.format.tar_writer import shard_writer
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS, check_image_file, open_image_header
from ddp_rank.data.reading.image_modes import grey16_to_l, is_grey16

_PIL_TO_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
_EXT_TO_PIL = {v: k for k, v in _PIL_TO_EXT.items()}


@dataclass(frozen=True)
class BuildOptions:
    """How to build. Defaults keep image bytes as they are."""

    max_samples: int = 1000
    """Most samples per shard (a class bigger than this gets a shard of its own)."""
    max_bytes: int = 256 * 2**20
    """Most image bytes per shard (same exception)."""
    test_fraction: float = 0.0
    """Fraction of each category's classes held out as the test split, for records without a split."""
    test_classes: TestClasses = "random"
    """Which classes ``test_fraction`` holds out: ``random`` (drawn with ``split_seed``) or ``last`` (the last
    ones in name order, numbers as numbers: the CUB / Cars196 protocol); see ``listing.assign_splits``."""
    split_seed: int = 0
    val_fraction: float = 0.0
    """Fraction of each category's training classes carved out as the ``val`` split (``carve_validation``),
    drawn with ``split_seed``; 0: no validation split."""
    resize: int | None = None
    """Shrink so the shorter side is at most this many pixels (re-encodes); None keeps the bytes."""
    image_format: str | None = None
    """Re-encode to jpg, png or webp; None keeps the source format (or jpg when resizing a format we do not store)."""
    quality: int = 90
    min_class_size: int = 2
    on_bad: OnBad = "error"
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """The pixel limit (width x height) of every image read (``decode``; ``--max-image-pixels``)."""
    workers: int = 1
    overwrite: bool = False
    progress: bool = True
    shared_classes: str | None = None
    """Why the splits may share classes (``--shared-classes``), recorded as the manifest's ``shared_classes``;
    None: a class of the ``train`` split in another split is refused (``class_leaks``)."""

    def __post_init__(self) -> None:
        check_reason(self.shared_classes)
        if self.max_samples < 1 or self.max_bytes < 1:
            raise ValueError("max_samples and max_bytes must be positive")
        if self.image_format is not None and self.image_format not in _EXT_TO_PIL:
            raise ValueError(f"image_format must be one of {sorted(_EXT_TO_PIL)}, got {self.image_format!r}")
        if self.test_classes not in TEST_CLASSES:
            raise ValueError(f"test_classes must be one of {list(TEST_CLASSES)}, got {self.test_classes!r}")
        if self.test_classes == "last" and self.test_fraction == 0.0:
            raise ValueError(
                "--test-classes last holds out the last classes of --test-fraction, which is 0: pass e.g. "
                "--test-fraction 0.5 (the first half of the classes train, the second half test)"
            )


_NOT_RECORDED = ("workers", "progress", "overwrite", "max_image_pixels", "shared_classes")
"""Options left out of the manifest's ``build`` record: how the build ran, not what it makes (the pixel limit
only refuses images, each named in the report); ``shared_classes`` has a field of the manifest's own."""


@dataclass(frozen=True)
class _PlannedSample:
    record: Record
    class_id: int
    category_id: int | None
    key: str


@dataclass(frozen=True)
class _ShardPlan:
    path: str
    category: int | None
    samples: tuple[_PlannedSample, ...]


@dataclass
class BuildResult:
    manifest: Manifest
    report: Report = field(default_factory=Report)


def build_shards(
    records: Sequence[Record],
    out_dir: str | os.PathLike[str],
    options: BuildOptions,
    report: Report | None = None,
) -> BuildResult:
    """Build the shard directory ``out_dir`` from ``records``; raises ``ListingError`` on bad input (see on_bad).

    What is skipped goes to ``report`` (a new one if None): a caller's report still holds it when the build
    then fails, so the command can show why nothing was left."""
    report = report if report is not None else Report()
    out = Path(out_dir)
    for split in sorted({r.split for r in records if r.split}):  # it names the folder its shards go to
        if problem := split_name_problem(split):
            raise ListingError(f"{problem}; rename it in the listing's split column")
    stale = check_out_dir(out, records, options.overwrite)
    recs = assign_splits(records, options.test_fraction, options.split_seed, options.test_classes)
    recs = carve_validation(recs, options.val_fraction, options.split_seed)
    _refuse_shared_classes(recs, options)  # before the images are read: a leak is the listing's, not theirs
    recs = _drop_unreadable(recs, options, report)
    recs = check_records(recs, options.min_class_size, options.on_bad, report)
    if not recs:
        raise ListingError("nothing left to write: --on-bad skip left out every image (the causes above)")
    categories, classes, ids = _number(recs)
    plans = _plan(recs, categories, classes, ids, options)
    remove_stale(out, stale)  # only now: bad input leaves an earlier build as it was
    written = _write_all(plans, out, options)
    manifest = _manifest(recs, categories, classes, ids, written, options, out)
    manifest.save(out)
    return BuildResult(manifest=manifest, report=report)


_SPLIT_BY_CLASS = (
    "split by class: --test-fraction F holds out whole classes of the records without a split (drawn, or the "
    "last ones with --test-classes last), and a listing's split column must give each class one split; or, "
    f"{RECORD_FIX}"
)


def _refuse_shared_classes(recs: Sequence[Record], options: BuildOptions) -> None:
    """A class (``class_key``) of the train split in another, unless ``options.shared_classes`` says why:
    ``ClassLeakError``."""
    if options.shared_classes:
        return
    members: dict[str, set[tuple[str | None, str]]] = defaultdict(set)
    for r in recs:
        members[r.split or "train"].add(class_key(r))
    problem = class_leak(members, lambda key: key[1] if key[0] is None else f"{key[0]}/{key[1]}")
    if problem is not None:
        raise ClassLeakError("the listing", problem, _SPLIT_BY_CLASS)


def check_image(path: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> str | None:
    """None if the file opens within ``max_pixels`` and its data verifies, else the reason (module level so
    worker processes can run it; ``decode.check_image_file``)."""
    return check_image_file(path, max_pixels)


def _drop_unreadable(recs: list[Record], options: BuildOptions, report: Report) -> list[Record]:
    """Verify every image once, in parallel, so a bad file is named before any shard is written."""
    paths = [r.path for r in recs]
    if options.workers > 1 and len(paths) > 256:
        with ProcessPoolExecutor(max_workers=options.workers) as pool:
            check = partial(check_image, max_pixels=options.max_image_pixels)
            reasons = list(pool.map(check, paths, chunksize=256))
    else:
        reasons = [check_image(p, options.max_image_pixels) for p in paths]
    bad = [f"unreadable image {p}: {why}" for p, why in zip(paths, reasons) if why is not None]
    kept = [r for r, why in zip(recs, reasons) if why is None]
    if bad and options.on_bad == "error":
        shown = "\n  ".join(bad[:10])
        raise ListingError(
            f"{len(bad)} unreadable image(s):\n  {shown}\nfix or remove them, or pass --on-bad skip to leave them out"
        )
    for path, why in zip(paths, reasons):
        if why is not None:  # grouped by the reason, without the file it may name
            cause = f"unreadable image ({why.replace(repr(path), 'the file')})"
            report.skip(cause, [path], [f"unreadable image {path}: {why}"])
    return kept


def _category_order(name: str | None) -> tuple[bool, tuple[tuple[tuple[int, int | str], ...], str]]:
    return (name is None, natural_key(name or ""))


def class_key(record: Record) -> tuple[str | None, str]:
    """What identifies a class: (category, class name); the same name under two categories is two classes."""
    return record.category, record.cls


def _number(recs: Sequence[Record]) -> tuple[list[str], list[ClassInfo], dict[tuple[str | None, str], int]]:
    """Category ids by sorted name; class ids grouped by category, then by name (contiguous within a category).
    Also returns the class id of each (category, class) key."""
    categories = sorted({r.category for r in recs if r.category is not None}, key=natural_key)
    cat_id = {c: i for i, c in enumerate(categories)}
    keys = sorted({class_key(r) for r in recs}, key=lambda k: (_category_order(k[0]), natural_key(k[1])))
    classes = [ClassInfo(id=i, name=cls, category=cat_id.get(cat or "")) for i, (cat, cls) in enumerate(keys)]
    return categories, classes, {k: i for i, k in enumerate(keys)}


def _plan(
    recs: Sequence[Record],
    categories: list[str],
    classes: list[ClassInfo],
    ids: dict[tuple[str | None, str], int],
    options: BuildOptions,
) -> list[_ShardPlan]:
    grouped: dict[str, dict[int, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in recs:
        grouped[r.split or "train"][ids[class_key(r)]].append(r)
    plans = []
    for split in sorted(grouped):
        by_class = grouped[split]
        for category in [*range(len(categories)), None]:
            class_ids = [cid for cid in sorted(by_class) if classes[cid].category == category]
            label = "unlabelled" if category is None else f"c{category:04d}"
            for index, chunk in enumerate(_chunks(class_ids, by_class, options)):
                samples = tuple(
                    _PlannedSample(r, cid, category, f"c{cid:07d}_{j:05d}")
                    for cid in chunk
                    for j, r in enumerate(
                        sorted(by_class[cid], key=lambda r: (r.subset or "", natural_key(r.path)))
                    )
                )
                plans.append(_ShardPlan(f"{split}/{split}-{label}-{index:05d}.tar", category, samples))
    return plans


def _chunks(
    class_ids: list[int], by_class: dict[int, list[Record]], options: BuildOptions
) -> Iterator[list[int]]:
    """Whole classes into shards within both bounds, and of even size: with k shards needed, shard i ends near
    (i + 1) / k of the category, so a category is never one full shard plus a tiny one."""
    counts = {cid: len(by_class[cid]) for cid in class_ids}
    sizes = {cid: sum(os.path.getsize(r.path) for r in by_class[cid]) for cid in class_ids}
    total_n, total_b = sum(counts.values()), sum(sizes.values())
    k = max(1, -(-total_n // options.max_samples), -(-total_b // options.max_bytes))
    chunk: list[int] = []
    count = size = done = shards = 0
    for cid in class_ids:
        n, nbytes = counts[cid], sizes[cid]
        over = count + n > options.max_samples or size + nbytes > options.max_bytes
        past_target = done + count + n / 2 > total_n * (shards + 1) / k
        if chunk and (over or past_target):
            yield chunk
            done, shards = done + count, shards + 1
            chunk, count, size = [], 0, 0
        chunk.append(cid)
        count += n
        size += nbytes
    if chunk:
        yield chunk


def image_bytes(path: str, options: BuildOptions) -> tuple[bytes, str]:
    """The stored bytes and extension: the file itself, or a resized / re-encoded copy when asked."""
    with open(path, "rb") as f:
        raw = f.read()
    # checked by check_image already; the same limit and formats
    with open_image_header(raw, path, options.max_image_pixels) as im:
        source_ext = _PIL_TO_EXT.get(im.format or "")
        target_ext = options.image_format or source_ext
        needs_resize = options.resize is not None and min(im.size) > options.resize
        if source_ext is not None and target_ext == source_ext and not needs_resize:
            return raw, source_ext
        target_ext = target_ext or "jpg"
        im.load()
        if is_grey16(im):  # 8 bits, as training decodes it (a plain conversion turns it white)
            im = grey16_to_l(im)
        if needs_resize and options.resize is not None:
            scale = options.resize / min(im.size)
            im = im.resize(
                (max(1, round(im.width * scale)), max(1, round(im.height * scale))), Image.Resampling.BICUBIC
            )
        if target_ext == "jpg" and im.mode not in ("RGB", "L"):
            im = im.convert("RGB")
        buf = io.BytesIO()
        save_kwargs: dict[str, Any] = {"quality": options.quality} if target_ext in ("jpg", "webp") else {}
        im.save(buf, format=_EXT_TO_PIL[target_ext], **save_kwargs)
        return buf.getvalue(), target_ext


def write_shard(
    plan: _ShardPlan,
    out_dir: Path,
    options: BuildOptions,
    class_names: Mapping[int, str],
    category_names: Mapping[int, str],
) -> ShardInfo:
    """Write one planned shard (called in a worker process); returns its manifest entry."""
    path = out_dir / plan.path
    path.parent.mkdir(parents=True, exist_ok=True)
    with shard_writer(path) as writer:
        for s in plan.samples:
            data, ext = image_bytes(s.record.path, options)
            meta = {
                "class": class_names[s.class_id],
                "category": None if s.category_id is None else category_names[s.category_id],
                "source": s.record.path,
            }
            if s.record.subset:
                meta["subset"] = s.record.subset
            writer.add(s.key, ext, data, s.class_id, meta)
        nbytes, digest = writer.close()
    return ShardInfo(
        path=plan.path,
        category=plan.category,
        classes=tuple(writer.spans),
        samples=len(plan.samples),
        bytes=nbytes,
        sha256=digest,
    )


def _write_all(plans: list[_ShardPlan], out: Path, options: BuildOptions) -> list[ShardInfo]:
    class_names, category_names = _names_of(plans)
    total = sum(len(p.samples) for p in plans)
    bar = tqdm(total=total, unit="img", desc="shards", disable=not options.progress)
    results: list[ShardInfo] = []
    try:
        if options.workers <= 1 or len(plans) == 1:
            for plan in plans:
                results.append(write_shard(plan, out, options, class_names, category_names))
                bar.update(len(plan.samples))
        else:
            work = partial(
                write_shard,
                out_dir=out,
                options=options,
                class_names=class_names,
                category_names=category_names,
            )
            with ProcessPoolExecutor(max_workers=options.workers) as pool:
                for plan, info in zip(plans, pool.map(work, plans)):
                    results.append(info)
                    bar.update(len(plan.samples))
    finally:
        bar.close()
    return results


def _names_of(plans: list[_ShardPlan]) -> tuple[dict[int, str], dict[int, str]]:
    class_names = {s.class_id: s.record.cls for p in plans for s in p.samples}
    category_names = {
        s.category_id: s.record.category or "" for p in plans for s in p.samples if s.category_id is not None
    }
    return class_names, category_names


def _manifest(
    recs: Sequence[Record],
    categories: list[str],
    classes: list[ClassInfo],
    ids: dict[tuple[str | None, str], int],
    written: list[ShardInfo],
    options: BuildOptions,
    out: Path,
) -> Manifest:
    splits: dict[str, SplitInfo] = {}
    for split in sorted({r.split or "train" for r in recs}):
        counts: dict[int, int] = defaultdict(int)
        for r in recs:
            if (r.split or "train") == split:
                counts[ids[class_key(r)]] += 1
        shards = tuple(s for s in written if s.path.startswith(f"{split}/"))
        splits[split] = SplitInfo(name=split, class_counts=dict(counts), shards=shards)
    build = {k: v for k, v in asdict(options).items() if k not in _NOT_RECORDED}
    return Manifest(
        categories=tuple(categories),
        classes=tuple(classes),
        splits=splits,
        build=build,
        root=str(out),
        shared_classes=check_reason(options.shared_classes),
    )
