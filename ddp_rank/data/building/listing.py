"""Listings: the table of (path, class, category, split, subset) a shard build starts from.

Two sources: an image folder (``root/<category>/<class>/<image>`` or ``root/<class>/<image>``) and a CSV/TSV
file with a header. Dataset recipes (``ddp_rank.data.building.recipes``) write such CSVs from a public dataset's own
files. Bad input is reported by name; with ``on_bad="skip"`` the offending rows are dropped and listed in the
report instead of stopping the build.
"""

from __future__ import annotations

import csv
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from ddp_rank.data.building.listing_columns import KNOWN_COLUMNS, resolve_columns
from ddp_rank.data.format.manifest_parts import natural_key  # the sort of ids (kept importable here)

OnBad = Literal["error", "skip"]
TestClasses = Literal["random", "last"]
TEST_CLASSES: tuple[str, ...] = ("random", "last")
"""How ``assign_splits`` picks each category's test classes: a seeded draw, or the last ones in name order."""
FOLDER_IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


@dataclass(frozen=True)
class Record:
    """One image of a listing. ``category`` None means unlabelled; ``split`` None means "not decided yet"."""

    path: str
    cls: str
    category: str | None = None
    split: str | None = None
    subset: str | None = None


class ListingError(ValueError):
    """Bad listing input; the message names the rows and the way out."""


@dataclass
class Report:
    """What was skipped (``on_bad="skip"``) or noticed, for the CLI to print.

    ``skipped`` holds every skipped item in full, one line each; ``causes`` groups the skipped items by why
    they were left out (``skip``), so that a thousand unreadable files read as one cause and a count
    (``summary``).
    """

    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    causes: dict[str, list[str]] = field(default_factory=dict)
    _grouped: Counter[str] = field(default_factory=Counter, repr=False)

    def skip(self, cause: str, items: Sequence[str], lines: Sequence[str] | None = None) -> None:
        """Record ``items`` as skipped for ``cause`` (a phrase naming the problem once); ``lines`` are their
        full lines in ``skipped`` (default: the items themselves)."""
        lines = items if lines is None else lines
        if items:
            self.skipped.extend(lines)
            self.causes.setdefault(cause, []).extend(items)
            self._grouped.update(lines)

    def extend(self, other: Report) -> None:
        self.skipped.extend(other.skipped)
        self.notes.extend(other.notes)
        for cause, items in other.causes.items():
            self.causes.setdefault(cause, []).extend(items)
        self._grouped.update(other._grouped)

    def summary(self, examples: int = 2) -> list[str]:
        """One line per cause: the count, the cause once and the first ``examples`` items; then the lines
        added to ``skipped`` without a cause, one by one."""
        out = []
        for cause, items in self.causes.items():
            shown = ", ".join(items[:examples]) + (", ..." if len(items) > examples else "")
            out.append(f"{len(items)} x {cause}: {shown}")
        grouped = Counter(self._grouped)
        for line in self.skipped:
            if grouped[line] > 0:
                grouped[line] -= 1
            else:
                out.append(line)
        return out


def _fail_or_skip(on_bad: OnBad, report: Report, problems: Sequence[str], fix: str, cause: str) -> None:
    if not problems:
        return
    if on_bad == "error":
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        raise ListingError(f"{len(problems)} problem(s) in the listing:\n  {shown}{more}\n{fix}")
    report.skip(cause, problems)


def read_image_folder(root: str | os.PathLike[str], report: Report | None = None) -> list[Record]:
    """List ``root/<class>/<image>`` or ``root/<category>/<class>/<image>`` (the depth must be the same everywhere).

    A class is identified by (category, class folder): the same folder name under two categories is two classes.
    Files that are not images of a known suffix, and hidden files and folders (``.DS_Store``, macOS ``._*``
    resource forks), are left out and counted in ``report.notes``.
    """
    base = Path(root)
    if not base.is_dir():
        raise ListingError(f"{base} is not a directory")
    files, ignored = [], []
    for p in sorted(base.rglob("*")):
        if not p.is_file():
            continue
        hidden = any(part.startswith(".") for part in p.relative_to(base).parts)
        if hidden or p.suffix.lower() not in FOLDER_IMAGE_SUFFIXES:
            ignored.append(str(p.relative_to(base)))
        else:
            files.append(p)
    if not files:
        raise ListingError(f"no images ({', '.join(sorted(FOLDER_IMAGE_SUFFIXES))}) found under {base}")
    if ignored and report is not None:
        shown = ", ".join(ignored[:5]) + (f", ... ({len(ignored) - 5} more)" if len(ignored) > 5 else "")
        report.notes.append(
            f"ignored {len(ignored)} file(s) under {base} that are hidden or not images "
            f"({', '.join(sorted(FOLDER_IMAGE_SUFFIXES))}): {shown}"
        )
    depths = Counter(len(p.relative_to(base).parts) for p in files)
    if set(depths) not in ({2}, {3}):
        raise ListingError(
            f"{base}: images must all be at root/<class>/<image> or all at root/<category>/<class>/<image>; "
            f"found path depths {dict(sorted(depths.items()))}"
        )
    records = []
    for p in files:
        parts = p.relative_to(base).parts
        category = parts[0] if len(parts) == 3 else None
        records.append(Record(path=str(p), cls=parts[-2], category=category))
    return records


RELATIVE_PATH_RULE = "relative paths in a listing are taken from the listing's own folder"
"""The rule ``read_csv_listing`` follows, stated where a user meets it (``shards build --help``, the docs)."""


def read_csv_listing(
    path: str | os.PathLike[str],
    on_bad: OnBad = "error",
    report: Report | None = None,
    columns: Mapping[str, str] | None = None,
) -> list[Record]:
    """Read a CSV (``,``) or TSV (``.tsv``: tab) listing with a header; relative paths are taken from its folder.

    ``columns`` maps a required column to the header's name for it (``{"class": "label"}`` reads the class
    from a ``label`` column), for listings exported by other tools. A listing none of whose relative paths
    exists (one moved away from its images) is refused with one line that states the rule, instead of one
    unreadable image per row.
    """
    report = report if report is not None else Report()
    src = Path(path)
    delimiter = "\t" if src.suffix.lower() == ".tsv" else ","
    # utf-8-sig: Excel's "CSV UTF-8" starts the file with a byte-order mark, which would glue onto "path"
    with src.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f, delimiter=delimiter)
        header = [h.strip() for h in (reader.fieldnames or [])]
        named, problems = resolve_columns(header, columns or {})
        if problems:
            raise ListingError(f"{src}: {'; '.join(problems)}")
        unknown = [c for c in header if c not in named.values()]
        _fail_or_skip(
            on_bad,
            report,
            [f"{src}: unknown column {c!r}" for c in unknown],
            f"known columns: {', '.join(KNOWN_COLUMNS)}; rename the column or pass --on-bad skip to ignore it",
            "unknown column, ignored",
        )
        records, relative = [], []
        for row in reader:
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            p = Path(row[named["path"]])
            if not p.is_absolute():
                relative.append(row[named["path"]])
                p = src.parent / p
            records.append(
                Record(
                    path=str(p),
                    cls=row[named["class"]],
                    category=row.get(named.get("category", "")) or None,
                    split=row.get(named.get("split", "")) or None,
                    subset=row.get(named.get("subset", "")) or None,
                )
            )
    _check_moved(src, relative)
    return records


def _check_moved(src: Path, relative: Sequence[str]) -> None:
    """Refuse a listing whose relative paths all miss: it was moved (or written from another folder)."""
    if not relative or any((src.parent / r).exists() for r in relative):
        return
    from_here = (
        " (they exist relative to the current folder instead)"
        if any(Path(r).exists() for r in relative[:100])
        else ""
    )
    raise ListingError(
        f"{src}: none of its {len(relative)} relative image path(s) exists: {RELATIVE_PATH_RULE}, "
        f"{src.parent.resolve()} (e.g. {relative[0]!r} -> {src.parent.resolve() / relative[0]}){from_here}; "
        "put the listing back beside the folder its paths start from, or write absolute paths"
    )


def write_csv_listing(records: Iterable[Record], path: str | os.PathLike[str]) -> int:
    """Write a listing CSV (paths relative to its folder when below it), atomically; returns the row count."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    n = 0
    with tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(KNOWN_COLUMNS)
        for r in records:
            p = Path(r.path)
            try:
                shown = str(p.resolve().relative_to(out.parent.resolve()))
            except ValueError:
                shown = str(p)
            writer.writerow([shown, r.cls, r.category or "", r.split or "", r.subset or ""])
            n += 1
    os.replace(tmp, out)
    return n


def check_records(
    records: Sequence[Record], min_class_size: int = 2, on_bad: OnBad = "error", report: Report | None = None
) -> list[Record]:
    """Reject duplicate paths and classes smaller than ``min_class_size`` per split. A class is identified by
    (category, class): the same class name under two categories is two classes."""
    report = report if report is not None else Report()
    seen: dict[tuple[str | None, str], int] = {}
    dupes = []
    unique = []
    for i, r in enumerate(records):
        key = (r.split, os.path.normpath(r.path))
        if key in seen:
            dupes.append(f"duplicate path {r.path} (rows {seen[key] + 1} and {i + 1})")
            continue
        seen[key] = i
        unique.append(r)
    _fail_or_skip(
        on_bad,
        report,
        dupes,
        "remove the repeated rows, or pass --on-bad skip to keep the first",
        "duplicate path, first row kept",
    )

    sizes = Counter((r.split, r.category, r.cls) for r in unique)
    small = sorted((k for k, n in sizes.items() if n < min_class_size), key=lambda k: tuple(map(str, k)))
    _fail_or_skip(
        on_bad,
        report,
        [
            f"class {c!r}{f' of category {g!r}' if g else ''} has {sizes[(s, g, c)]} image(s) in split "
            f"{s or '(all)'}"
            for s, g, c in small
        ],
        f"every class needs at least {min_class_size} images to have a positive pair; pass --on-bad skip to drop "
        "such classes or --min-class-size 1 to keep them",
        f"class with fewer than {min_class_size} images in a split (--min-class-size), dropped",
    )
    small_set = set(small)
    return [r for r in unique if (r.split, r.category, r.cls) not in small_set]


VAL_SPLIT = "val"
"""The split ``carve_validation`` makes: classes held out of training to choose a run's settings on."""


def carve_validation(
    records: Sequence[Record], fraction: float, seed: int, source: str = "train"
) -> list[Record]:
    """Move, within each category, ``round(fraction * n_classes)`` seeded classes of split ``source`` (records
    with no split count as ``source``) into the ``val`` split, keeping at least one class of the category in
    ``source``.

    A validation split of disjoint classes is what every choice of a study (a learning rate, a stopping point, a
    best batch) is made on, so that the test split is looked at once, by the runs already chosen. The draw uses
    its own stream of ``seed`` (not the test split's), so adding a validation split leaves the test classes as
    they were. ``fraction`` 0 returns the records unchanged.
    """
    if not 0.0 <= fraction < 1.0:
        raise ListingError(f"validation fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return list(records)
    if any(r.split == VAL_SPLIT for r in records):
        raise ListingError(
            f"the listing already has a {VAL_SPLIT!r} split: keep it (drop --val-fraction) or rename it in the "
            "listing's split column"
        )
    by_category: dict[str | None, set[str]] = defaultdict(set)
    for r in records:
        if (r.split or source) == source:
            by_category[r.category].add(r.cls)
    if not by_category:
        raise ListingError(f"no {source!r} classes to carve a validation split from")
    carved: set[tuple[str | None, str]] = set()
    rng = np.random.default_rng([seed, 1])  # a stream of its own: the test draw (seed alone) is unchanged
    for category in sorted(by_category, key=lambda c: (c is None, c or "")):
        names = sorted(by_category[category], key=natural_key)
        n_val = min(round(fraction * len(names)), len(names) - 1)
        carved.update((category, names[i]) for i in rng.permutation(len(names))[:n_val])
    return [
        replace(r, split=VAL_SPLIT) if (r.split or source) == source and (r.category, r.cls) in carved else r
        for r in records
    ]


def assign_splits(
    records: Sequence[Record], test_fraction: float, seed: int, test_classes: TestClasses = "random"
) -> list[Record]:
    """Split by class: within each category, ``round(test_fraction * n_classes)`` classes go to test.

    ``test_classes`` says which: ``"random"`` draws them with ``seed``; ``"last"`` takes the last ones in name
    order (numbers compared as numbers, the order of the manifest's class ids), so the first classes train: the
    CUB-200-2011 and Cars196 protocol (first half of the classes for training, second half for test), for any
    folder or listing whose class names carry that order. Stratifying by category keeps every category in both
    splits, so the held-out classes look like the train ones (the SOP protocol: train classes vs disjoint test
    classes). Records that already have a split keep it.
    """
    if not 0.0 <= test_fraction < 1.0:
        raise ListingError(f"test fraction must be in [0, 1), got {test_fraction}")
    if test_classes not in TEST_CLASSES:
        raise ListingError(f"test classes must be one of {list(TEST_CLASSES)}, got {test_classes!r}")
    by_category: dict[str | None, set[str]] = defaultdict(set)
    for r in records:
        if r.split is None:
            by_category[r.category].add(r.cls)
    held_out: set[tuple[str | None, str]] = set()
    rng = np.random.default_rng(seed)
    for category in sorted(by_category, key=lambda c: (c is None, c or "")):
        names = sorted(by_category[category], key=natural_key)
        n_test = round(test_fraction * len(names))
        chosen: Iterable[int] = (
            range(len(names) - n_test, len(names))
            if test_classes == "last"
            else rng.permutation(len(names))[:n_test].tolist()
        )
        held_out.update((category, names[i]) for i in chosen)
    return [
        r if r.split is not None else replace(r, split="test" if (r.category, r.cls) in held_out else "train")
        for r in records
    ]
