"""``ddp-rank shards build`` and ``ddp-rank shards listing``: a listing (an image folder, a CSV/TSV, or a
public dataset's own files through a recipe) turned into shards. Thin: parse and call."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from ddp_rank.cli.arguments import CPU_CORES, add_max_image_pixels, add_on_bad
from ddp_rank.cli.command import Command
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import (
    RELATIVE_PATH_RULE,
    TEST_CLASSES,
    ListingError,
    Record,
    Report,
    read_csv_listing,
    read_image_folder,
    write_csv_listing,
)
from ddp_rank.data.building.recipes import RECIPES, run_recipe
from ddp_rank.data.format.class_leaks import SHARED_CLASSES_HELP, SHARED_CLASSES_OPTION, ClassLeakError
from ddp_rank.data.format.info import format_info

_BUILD_DESCRIPTION = f"""\
Write shards and manifest.json from an image folder (root/<category>/<class>/<img> or root/<class>/<img>) or a
CSV/TSV listing with a header (path and class required; category, split, subset optional). Classes are split
whole: a listing's split column, else --test-fraction. Paths: {RELATIVE_PATH_RULE}, not from the
current folder, so keep a listing beside the folder its relative paths start from (or write absolute paths).

examples:
  ddp-rank shards build photos/ data/photos --test-fraction 0.5 --val-fraction 0.1 --resize 256
  ddp-rank shards build photos/ data/photos --test-fraction 0.5 --test-classes last   # first half trains
  ddp-rank shards build export.csv data/export --class-column label   # a header path,label
  ddp-rank shards listing cub /data/CUB_200_2011 cub.csv && ddp-rank shards build cub.csv data/cub-shards
"""


def _build_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="image folder (root/<category>/<class>/<img> or root/<class>/<img>) or .csv/.tsv listing "
        f"({RELATIVE_PATH_RULE})",
    )
    p.add_argument("out", help="output directory (must be new or empty, see --overwrite)")
    p.add_argument("--test-fraction", type=float, default=0.0, help="fraction of classes held out as test")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="fraction of each category's training classes carved out as the val split, to choose "
        "settings on without the test split (drawn with --split-seed; recorded in the manifest)",
    )
    p.add_argument(
        "--test-classes",
        choices=TEST_CLASSES,
        default="random",
        help="which classes --test-fraction holds out in each category: 'random' (drawn with --split-seed) or "
        "'last' (the last ones by name, numbers compared as numbers, so the first ones train: the CUB / Cars196 "
        "protocol for classes named in their order); recorded in the manifest",
    )
    p.add_argument("--split-seed", type=int, default=0, help="seed of the draw of the held-out classes")
    p.add_argument(
        "--class-column",
        default=None,
        metavar="NAME",
        help="listing: read the class from column NAME (e.g. label) instead of 'class'",
    )
    p.add_argument(
        "--path-column",
        default=None,
        metavar="NAME",
        help="listing: read the image path from column NAME (e.g. filepath) instead of 'path'",
    )
    p.add_argument("--max-samples", type=int, default=1000, help="most samples per shard")
    p.add_argument("--max-mb", type=float, default=256.0, help="most MB of images per shard")
    p.add_argument("--resize", type=int, default=None, help="shrink the shorter side to this (re-encodes)")
    p.add_argument(
        "--format", dest="image_format", choices=("jpg", "png", "webp"), help="re-encode (default: keep)"
    )
    p.add_argument("--quality", type=int, default=90, help="jpg/webp quality of re-encoded images")
    p.add_argument(
        "--min-class-size", type=int, default=2, help="fewest images of a class per split (see --on-bad)"
    )
    add_on_bad(p, "error", "stop on bad input (default) or skip it and list what was skipped")
    add_max_image_pixels(p, "is unreadable (see --on-bad)")
    p.add_argument(
        "--workers", type=int, default=CPU_CORES, help="encoding processes (default: the CPU cores)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the shards and manifest of an earlier build in OUT (nothing else there is touched)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(SHARED_CLASSES_OPTION, default=None, metavar="REASON", help=SHARED_CLASSES_HELP)


def _listing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", choices=sorted(RECIPES), help="the public dataset whose files are read")
    p.add_argument(
        "root",
        help="the dataset folder (cub: CUB_200_2011; cars: the folder of cars_annos.mat and car_ims/; emoji, "
        "words: the download cache folder)",
    )
    p.add_argument("out", help="listing CSV to write")
    p.add_argument(
        "--size", type=int, default=64, help="emoji: render size of the openmoji SVGs; words: image size"
    )
    p.add_argument(
        "--test-fraction",
        type=float,
        default=None,
        help="emoji, inat, words: fraction of classes held out (emoji 0.5, inat 0.3 without split lists, "
        "words 0.2)",
    )
    p.add_argument("--seed", type=int, default=0, help="emoji, inat, words: split seed")
    p.add_argument("--words", type=int, default=26_000, help="words: how many words (classes), common first")
    p.add_argument(
        "--train-list", default=None, help="inat: the published train split (image paths or class ids)"
    )
    p.add_argument("--test-list", default=None, help="inat: the published test split")
    p.add_argument("--workers", type=int, default=CPU_CORES, help="emoji, words: render workers")


def _print_report(report: Report) -> None:
    if report.skipped:
        print(f"skipped {len(report.skipped)} item(s):", file=sys.stderr)
        for line in report.summary():
            print(f"  {line}", file=sys.stderr)
    for note in report.notes:
        print(note, file=sys.stderr)


def load_records(
    source: str, on_bad: str, report: Report, columns: dict[str, str] | None = None
) -> list[Record]:
    """The records of an image folder or a CSV/TSV listing (``columns``: a listing's mapped column names)."""
    path = Path(source)
    if path.is_dir():
        if columns:
            raise ListingError(
                f"{source} is a folder: --class-column and --path-column are for a CSV/TSV listing"
            )
        return read_image_folder(path, report)
    if path.suffix.lower() in (".csv", ".tsv"):
        return read_csv_listing(path, on_bad=on_bad, report=report, columns=columns)  # type: ignore[arg-type]
    raise ListingError(f"{source} is neither a directory nor a .csv/.tsv listing")


def _columns(args: argparse.Namespace) -> dict[str, str]:
    given = {"class": args.class_column, "path": args.path_column}
    return {known: name for known, name in given.items() if name}


def _build_options(args: argparse.Namespace) -> BuildOptions:
    """The ``BuildOptions`` of ``shards build``: each field is the option of its name (``--format`` has
    ``dest="image_format"``) but the two given in other units, ``--max-mb`` and ``--no-progress``.

    A field added without an option of its name fails here, at the first build, rather than going unset.
    """
    converted: dict[str, Any] = {"max_bytes": int(args.max_mb * 2**20), "progress": not args.no_progress}
    same_name = {f.name: getattr(args, f.name) for f in fields(BuildOptions) if f.name not in converted}
    return BuildOptions(**same_name, **converted)


def _build(args: argparse.Namespace) -> int:
    report = Report()
    try:
        records = load_records(args.source, args.on_bad, report, _columns(args))
        build_shards(records, args.out, _build_options(args), report)
    except ClassLeakError as exc:  # the listing's split: name the file
        print(f"error: {exc.at(args.source)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:  # ListingError is a ValueError; FileExistsError an OSError
        _print_report(report)  # what --on-bad skip left out, so that "nothing left" has its causes above it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_report(report)  # the build added to it (result.report)
    print(format_info(args.out))
    return 0


def _listing(args: argparse.Namespace) -> int:
    options: dict[str, Any] = {}
    if args.recipe == "emoji":
        options = {
            "size": args.size,
            "test_fraction": 0.5 if args.test_fraction is None else args.test_fraction,
            "seed": args.seed,
            "workers": args.workers,
        }
    elif args.recipe == "words":
        options = {
            "size": args.size,
            "words": args.words,
            "test_fraction": 0.2 if args.test_fraction is None else args.test_fraction,
            "seed": args.seed,
            "workers": args.workers,
        }
    elif args.recipe == "inat":
        options = {"train_list": args.train_list, "test_list": args.test_list, "seed": args.seed}
        if args.test_fraction is not None:
            options["test_fraction"] = args.test_fraction
    try:
        records = run_recipe(args.recipe, args.root, **options)
    except (ListingError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n = write_csv_listing(records, args.out)
    classes = len({(r.category, r.cls) for r in records})
    categories = len({r.category for r in records if r.category is not None})
    print(f"wrote {args.out}: {n} images, {classes} classes, {categories} categories")
    return 0


BUILD = Command(
    "build",
    help="write shards + manifest.json from an image folder or a CSV/TSV listing",
    description=_BUILD_DESCRIPTION,
    raw_description=True,
    arguments=_build_arguments,
    run=_build,
)
LISTING = Command(
    "listing",
    help="write a listing CSV from a public dataset's own files (a recipe)",
    description="Write a listing CSV from a public dataset's own files. cub and cars write the field's "
    "split (the first half of the classes by id train, the second half test) and the real class names; "
    "sop, inshop, vehicleid and inat keep their files' splits. Then: ddp-rank shards build OUT.csv SHARDS.",
    arguments=_listing_arguments,
    run=_listing,
)
