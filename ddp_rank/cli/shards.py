"""``ddp-rank shards ...``: build, verify, info, and the dataset recipes (``listing``). Thin: parse and call.

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
import os
import sys
from pathlib import Path
from typing import Any

from ddp_rank.cli.arguments import pixel_count
from ddp_rank.cli.shards_convert import convert_command
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import (
    ListingError,
    Record,
    Report,
    read_csv_listing,
    read_image_folder,
    write_csv_listing,
)
from ddp_rank.data.building.recipes import RECIPES, run_recipe
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.info import format_info
from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS

_CORES = os.cpu_count() or 1  # the default of --workers


def register(subparsers: Any) -> None:
    shards = subparsers.add_parser("shards", help="prepare, check and describe WebDataset shards")
    sub = shards.add_subparsers(dest="shards_command", metavar="SUBCOMMAND", required=True)
    _add_build(sub)
    verify = sub.add_parser("verify", help="check checksums, counts and that every image decodes")
    verify.add_argument("directory", help="shard directory or URL (holding manifest.json)")
    verify.add_argument("--no-decode", action="store_true", help="skip decoding the images (faster)")
    verify.add_argument("--workers", type=int, default=_CORES, help="processes (default: the CPU cores)")
    add_max_image_pixels(verify, "is a problem, as in training")
    verify.set_defaults(func=_verify)
    info = sub.add_parser("info", help="table of classes, images, shards and size per split and category")
    info.add_argument("directory", help="shard directory or URL (holding manifest.json)")
    info.set_defaults(func=_info)
    _add_index(sub)
    _add_reshard(sub)
    _add_features(sub)
    _add_whiten(sub)
    _add_listing(sub)
    serve = sub.add_parser("serve", help="serve a shard directory over HTTP with Range requests")
    serve.add_argument("directory", help="shard directory to serve")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: this machine only)")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.set_defaults(func=_serve)


def add_max_image_pixels(p: argparse.ArgumentParser, what: str) -> None:
    """``--max-image-pixels``: the pixel limit of the images a command reads (``decode``)."""
    p.add_argument(
        "--max-image-pixels",
        type=pixel_count,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help=f"an image larger than this (width x height, from its header) {what} "
        f"(data.max_image_pixels; default {DEFAULT_MAX_IMAGE_PIXELS:,})",
    )


def _add_index(sub: Any) -> None:
    p = sub.add_parser(
        "index",
        help="write manifest.json for WebDataset shards made by other tools (the tars are not rewritten)",
    )
    p.add_argument(
        "directory",
        help="directory or URL holding the .tar shards, or the shards themselves: a brace pattern "
        "('DIR/data-{000000..000099}.tar', a split 'train'), a glob or one tar",
    )
    p.add_argument(
        "--out", default=None, help="where to write manifest.json (default: DIRECTORY; required for a URL)"
    )
    _add_index_options(p, "category")
    p.add_argument("--upgrade", action="store_true", help="add byte ranges to a version-1 ddp_rank manifest")
    p.set_defaults(func=_index)


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


def _add_reshard(sub: Any) -> None:
    p = sub.add_parser(
        "reshard",
        help="rewrite shards of any layout (local or a URL; indexed, or plain or compressed tars with the index "
        "options) into one category per shard, classes contiguous",
    )
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
    _add_index_options(p, None)
    p.set_defaults(func=_reshard)


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
        )
        index = _index_options(args) if any(v is not None for v in named) else None
        reshard(args.source, args.out, options, index=index, splits=tuple(args.split))
    except (OSError, ValueError) as exc:  # ReshardError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_info(args.out))
    return 0


def _add_features(sub: Any) -> None:
    from ddp_rank.cli.arguments import add_config_arguments

    p = sub.add_parser(
        "features",
        help="embed every image of a shard set once with the config's frozen backbone: feature shards "
        "(train a head on them with model.backbone=features)",
    )
    p.add_argument("source", help="image shard directory or URL (made by `shards build` or `shards index`)")
    p.add_argument("out", help="directory to write the feature shards to (new, or an unfinished build)")
    add_config_arguments(p, "experiment YAML: model.backbone/weights/pooling and data.* sizes and crop")
    p.add_argument("--batch-size", type=int, default=256, help="images per forward pass (default 256)")
    p.add_argument("--overwrite", action="store_true", help="replace the feature shards in OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_features)


def _add_whiten(sub: Any) -> None:
    p = sub.add_parser(
        "whiten",
        help="PCA-whiten the vectors of feature shards (fitted on the training split): a head trains on them "
        "in a few epochs",
    )
    p.add_argument("source", help="feature shard directory or URL (made by `shards features`)")
    p.add_argument("out", help="directory to write the whitened shards to (new, or an unfinished build)")
    p.add_argument("--dim", type=int, default=None, help="axes kept, largest variance first (default: all)")
    p.add_argument(
        "--shrinkage",
        type=float,
        default=1e-4,
        help="added to each eigenvalue, times their mean, before dividing by its root (default 1e-4)",
    )
    p.add_argument("--split", default="train", help="the split the map is fitted on (default: train)")
    p.add_argument("--overwrite", action="store_true", help="replace the whitened shards in OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_whiten)


def _add_build(sub: Any) -> None:
    p = sub.add_parser("build", help="write shards + manifest.json from an image folder or a CSV/TSV listing")
    p.add_argument(
        "source", help="image folder (root/<category>/<class>/<img> or root/<class>/<img>) or .csv/.tsv"
    )
    p.add_argument("out", help="output directory (must be new or empty, see --overwrite)")
    p.add_argument("--test-fraction", type=float, default=0.0, help="fraction of classes held out as test")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="fraction of each category's training classes carved out as the val split, to choose "
                   "settings on without the test split (drawn with --split-seed; recorded in the manifest)")  # fmt: skip
    p.add_argument("--split-seed", type=int, default=0, help="seed of the draw of the held-out classes")
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
    p.add_argument(
        "--on-bad",
        choices=("error", "skip"),
        default="error",
        help="stop on bad input (default) or skip it and list what was skipped",
    )
    add_max_image_pixels(p, "is unreadable (see --on-bad)")
    p.add_argument("--workers", type=int, default=_CORES, help="encoding processes (default: the CPU cores)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the shards and manifest of an earlier build in OUT (nothing else there is touched)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_build)


def _add_listing(sub: Any) -> None:
    p = sub.add_parser("listing", help="write a listing CSV from a public dataset's own files (a recipe)")
    p.add_argument("recipe", choices=sorted(RECIPES), help="the public dataset whose files are read")
    p.add_argument("root", help="the dataset folder (emoji: the download cache folder)")
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
    p.add_argument("--workers", type=int, default=_CORES, help="emoji, words: render workers")
    p.set_defaults(func=_listing)


def _print_report(report: Report) -> None:
    if report.skipped:
        print(f"skipped {len(report.skipped)} item(s):", file=sys.stderr)
        for line in report.skipped:
            print(f"  {line}", file=sys.stderr)
    for note in report.notes:
        print(note, file=sys.stderr)


def load_records(source: str, on_bad: str, report: Report) -> list[Record]:
    path = Path(source)
    if path.is_dir():
        return read_image_folder(path, report)
    if path.suffix.lower() in (".csv", ".tsv"):
        return read_csv_listing(path, on_bad=on_bad, report=report)  # type: ignore[arg-type]
    raise ListingError(f"{source} is neither a directory nor a .csv/.tsv listing")


def _build(args: argparse.Namespace) -> int:
    report = Report()
    try:
        records = load_records(args.source, args.on_bad, report)
        options = BuildOptions(
            max_samples=args.max_samples,
            max_bytes=int(args.max_mb * 2**20),
            test_fraction=args.test_fraction,
            split_seed=args.split_seed,
            val_fraction=args.val_fraction,
            resize=args.resize,
            image_format=args.image_format,
            quality=args.quality,
            min_class_size=args.min_class_size,
            on_bad=args.on_bad,
            max_image_pixels=args.max_image_pixels,
            workers=args.workers,
            overwrite=args.overwrite,
            progress=not args.no_progress,
        )
        result = build_shards(records, args.out, options)
    except (ValueError, OSError) as exc:  # ListingError is a ValueError; FileExistsError an OSError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report.extend(result.report)
    _print_report(report)
    print(format_info(args.out))
    return 0


def _features(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from ddp_rank.config import ConfigError, load_config
    from ddp_rank.features.build import FeatureBuildError, FeatureBuildOptions, build_feature_shards
    from ddp_rank.model import ModelError
    from ddp_rank.runtime import make_accelerator
    from ddp_rank.runtime.settings import data_settings, model_settings

    accelerator = None
    try:
        if args.batch_size < 1:
            raise FeatureBuildError(f"--batch-size must be at least 1, got {args.batch_size}")
        cfg = load_config(args.config, args.overrides)
        accelerator = make_accelerator(cfg)
        options = FeatureBuildOptions(args.batch_size, args.overwrite, not args.no_progress)
        model, data = model_settings(cfg), data_settings(cfg)
        manifest = build_feature_shards(model, data, args.source, args.out, accelerator, options)
    except (ConfigError, ModelError, FeatureBuildError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if accelerator is not None:
            accelerator.end_training()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    if manifest is not None:
        print(format_info(args.out))
    return 0


def _whiten(args: argparse.Namespace) -> int:
    from ddp_rank.features.build import FeatureBuildError
    from ddp_rank.features.whiten import WhitenOptions, whiten_feature_shards

    try:
        options = WhitenOptions(args.dim, args.shrinkage, args.split, args.overwrite, not args.no_progress)
        manifest, eigenvalues = whiten_feature_shards(args.source, args.out, options)
    except (FeatureBuildError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    kept = manifest.build["features"]["dim"]
    share = float(eigenvalues[:kept].sum() / eigenvalues.sum())
    print(f"whitened: {kept} of {len(eigenvalues)} axes, {share:.1%} of the {args.split} vectors' variance")
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
        if args.upgrade:
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
            report = index_shards(root, splits, options, out)
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
    print(f"wrote {args.out}: {n} images, {classes} classes, {len({r.category for r in records})} categories")
    return 0
