"""``ddp-rank shards ...``: every shard subcommand; verify, info, index, reshard and serve here, build and listing
in ``shards_build``, features and whiten in ``shards_features``. Thin: parse and call.

Examples::

    ddp-rank shards listing emoji ~/.cache/ddp_rank/emoji emoji.csv --size 64
    ddp-rank shards listing words ~/.cache/ddp_rank/words words.csv --size 64 --words 26000
    ddp-rank shards listing inat /data/iNat2018 inat.csv --train-list Inaturalist_train_set1.txt \
        --test-list Inaturalist_test_set1.txt
    ddp-rank shards build emoji.csv data/emoji-shards --workers 2 --max-samples 500
    ddp-rank shards build photos/ data/photos --test-fraction 0.5 --val-fraction 0.1 --resize 256
    ddp-rank shards verify data/emoji-shards
    ddp-rank shards info data/emoji-shards
    ddp-rank shards index data/laion-subset --split train='train-*.tar' --class-field label
    ddp-rank shards reshard data/laion-subset data/laion-contiguous --max-samples 2000 --memory-mb 512
    ddp-rank shards features data/emoji-shards data/emoji-features --config configs/demo.yaml
    ddp-rank shards whiten data/emoji-features data/emoji-whitened
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any

from ddp_rank.cli import shards_build, shards_features
from ddp_rank.cli.arguments import CPU_CORES, add_max_image_pixels
from ddp_rank.cli.command import Command
from ddp_rank.cli.shards_convert import convert_command
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.class_leaks import SHARED_CLASSES_HELP, SHARED_CLASSES_OPTION, record_shared_classes
from ddp_rank.data.format.info import format_info


def _verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="shard directory or URL (holding manifest.json)")
    p.add_argument("--no-decode", action="store_true", help="skip decoding the images (faster)")
    p.add_argument("--workers", type=int, default=CPU_CORES, help="processes (default: the CPU cores)")
    add_max_image_pixels(p, "is a problem, as in training")


def _info_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="shard directory or URL (holding manifest.json)")


def _index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "directory",
        help="directory or URL holding the .tar shards, or the shards themselves: a brace pattern "
        "('DIR/data-{000000..000099}.tar', a split 'train'), a glob or one tar",
    )
    p.add_argument(
        "--out", default=None, help="where to write manifest.json (default: DIRECTORY; required for a URL)"
    )
    _add_index_options(p, "category")
    p.add_argument(
        "--upgrade",
        action="store_true",
        help="add byte ranges to a version-1 ddp_rank manifest; with --shared-classes, only record the reason "
        "in the manifest in place",
    )
    p.add_argument(SHARED_CLASSES_OPTION, default=None, metavar="REASON", help=SHARED_CLASSES_HELP)


def _add_index_options(p: argparse.ArgumentParser, category_default: str | None) -> None:
    """The options that say which shards make which split and where a sample's class and category are:
    ``index``'s, and ``reshard``'s for a source without a manifest."""
    p.add_argument(
        "--split",
        action="append",
        default=[],
        metavar="NAME=PATTERN",
        help="shards of a split, e.g. train='train-{000..099}.tar' or, locally, train='train-*.tar' "
        "(repeatable); default for a directory: one split per sub-directory, else every tar is 'train'",
    )
    p.add_argument(
        "--class-field",
        default=None,
        help="the member (its extension: txt for a .txt class) or json field of the class (default: the .cls "
        "member, then the json field 'class')",
    )
    p.add_argument(
        "--class-from-key",
        default=None,
        metavar="SEP",
        help="take the class from the sample key, up to its last SEP (n01440764_10026 with _: n01440764)",
    )
    p.add_argument(
        "--category-field",
        default=category_default,
        help="the member (its extension) or json field of the category (default: category)",
    )
    p.add_argument(
        "--category-map", default=None, help="CSV with columns class,category (wins over the json)"
    )


def _index_options(args: argparse.Namespace) -> Any:
    from ddp_rank.data.building.shard_index import IndexOptions, read_category_map

    category_field = "category" if args.category_field is None else args.category_field
    return IndexOptions(
        class_field=args.class_field,
        class_from_key=args.class_from_key or None,
        category_field=category_field or None,
        category_map=read_category_map(args.category_map) if args.category_map else {},
    )


def _reshard_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "source",
        help="directory or URL holding manifest.json (shards made by `shards index`, or any); or shards "
        "without one, plain or compressed (.tar.gz, .tgz, .tar.bz2, .tar.xz): a directory, a brace pattern, "
        "or --split, indexed first (with --class-field ...), compressed ones decompressed once",
    )
    p.add_argument(
        "out", help="output directory (new or empty; or that of an interrupted reshard, to resume it)"
    )
    p.add_argument("--max-samples", type=int, default=1000, help="most samples per output shard")
    p.add_argument("--max-mb", type=float, default=256.0, help="most MB per output shard")
    p.add_argument(
        "--memory-mb", type=float, default=256.0, help="most MB of source bytes held in memory at once"
    )
    p.add_argument("--decode", action="store_true", help="also decode every image in the final verification")
    add_max_image_pixels(p, "fails that --decode")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(SHARED_CLASSES_OPTION, default=None, metavar="REASON", help=SHARED_CLASSES_HELP)
    _add_index_options(p, None)


def _reshard(args: argparse.Namespace) -> int:
    from ddp_rank.data.building.reshard import ReshardOptions, reshard

    named = (args.class_field, args.class_from_key, args.category_field, args.category_map)
    try:
        options = ReshardOptions(
            max_samples=args.max_samples,
            max_bytes=int(args.max_mb * 2**20),
            memory_bytes=int(args.memory_mb * 2**20),
            decode=args.decode,
            max_image_pixels=args.max_image_pixels,
            progress=not args.no_progress,
            shared_classes=args.shared_classes,
        )
        index = _index_options(args) if any(v is not None for v in named) else None
        reshard(args.source, args.out, options, index=index, splits=tuple(args.split))
    except (OSError, ValueError) as exc:  # ReshardError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_info(args.out))
    return 0


def _verify(args: argparse.Namespace) -> int:
    try:
        problems = verify_shards(
            args.directory, not args.no_decode, args.workers, max_pixels=args.max_image_pixels
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"FAILED: {len(problems)} problem(s) in {args.directory}", file=sys.stderr)
        return 1
    print(f"OK: {args.directory}")
    return 0


def _info(args: argparse.Namespace) -> int:
    try:
        print(format_info(args.directory))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _index(args: argparse.Namespace) -> int:
    from ddp_rank.data.building.shard_index import (
        ShardIndexError,
        index_shards,
        source_splits,
        upgrade_manifest,
    )
    from ddp_rank.data.format.compressed import CompressedShardError
    from ddp_rank.data.format.manifest import is_url

    out = args.out
    try:
        if args.upgrade and args.shared_classes is not None:
            record_shared_classes(args.directory, args.shared_classes)
            out = args.directory
        elif args.upgrade:
            upgrade_manifest(args.directory)
            out = args.directory
        else:
            options = _index_options(args)
            root, splits = source_splits(args.directory, args.split)
            out = args.out or root
            if is_url(out):
                raise ShardIndexError(
                    f"{args.directory} is a URL: pass --out DIR, where to write manifest.json"
                )
            report = index_shards(root, splits, options, out, shared_classes=args.shared_classes)
            if report.skipped_samples:
                print(f"left out {report.skipped_samples} sample(s) without an image member", file=sys.stderr)
            Path(out).mkdir(parents=True, exist_ok=True)
            report.manifest.save(out)
    except CompressedShardError as exc:
        print(f"error: {exc.with_command(convert_command(args))}", file=sys.stderr)
        return 2
    except (ShardIndexError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_info(out))
    return 0


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", help="shard directory to serve")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")


def _serve(args: argparse.Namespace) -> int:
    from ddp_rank.data.reading.serve import serve_forever

    def announce(url: str) -> None:
        print(f"serving {args.directory} at {url} (Ctrl-C stops)", flush=True)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            serve_forever(args.directory, args.host, args.port, on_ready=announce)
    except OSError as exc:  # no such folder; the address in use or not ours to bind
        print(f"ddp-rank shards serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


COMMAND = Command(
    "shards",
    help="prepare, check and describe WebDataset shards",
    subcommands=(
        shards_build.BUILD,
        Command(
            "verify",
            help="check checksums, counts and that every image decodes",
            arguments=_verify_arguments,
            run=_verify,
        ),
        Command(
            "info",
            help="table of classes, images, shards and size per split and category",
            arguments=_info_arguments,
            run=_info,
        ),
        Command(
            "index",
            help="write manifest.json for WebDataset shards made by other tools (the tars are not rewritten)",
            arguments=_index_arguments,
            run=_index,
        ),
        Command(
            "reshard",
            help="rewrite shards of any layout (local or a URL; indexed, or plain or compressed tars with the "
            "index options) into one category per shard, classes contiguous",
            arguments=_reshard_arguments,
            run=_reshard,
        ),
        *shards_features.COMMANDS,
        shards_build.LISTING,
        Command(
            "serve",
            help="serve a shard directory over HTTP with Range requests",
            arguments=_serve_arguments,
            run=_serve,
        ),
    ),
)
