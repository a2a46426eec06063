"""``ddp-rank export`` / ``ddp-rank index`` / ``ddp-rank search``: from a trained run to a retrieval system.

Examples::

    ddp-rank export --checkpoint runs/demo --output runs/demo/export              # the run's test split
    ddp-rank export --checkpoint runs/demo --images photos/ --output photos-export
    accelerate launch --config_file launch/accelerate_cpu_2proc.yaml -m ddp_rank.cli export \\
        --checkpoint runs/demo --shards-url 'https://host/shards/test-{00000..00009}.tar' --output web-export
    ddp-rank index runs/demo/export --kind hnsw --output runs/demo/index         # prints its recall vs exact
    ddp-rank search runs/demo/index query.jpg other.png -k 5

Thin: the work is in ``ddp_rank.eval.export``, ``.index``, ``.search`` and ``.sources``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_rank.cli.arguments import add_config_arguments, add_on_bad, pixel_count
from ddp_rank.cli.command import Command
from ddp_rank.config import ConfigError

__all__ = ["COMMANDS"]


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="run directory (best, else latest checkpoint) or a step-* directory")
    add_config_arguments(p, "experiment YAML; default: the run's own config.yaml")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--split", help="split of data.shards (default: data.test_split)")
    source.add_argument("--images", help="a folder of images (searched recursively; keys: relative paths)")
    source.add_argument("--shards-url", help="WebDataset shards: a URL or path, brace patterns allowed")
    p.add_argument("--output", required=True, help="export directory to write")
    add_on_bad(
        p,
        "skip",
        "an image that does not decode: leave it out with a line naming it (default; --images and "
        "--shards-url also list it in export.json) or stop at it (--images, --shards-url)",
    )
    p.add_argument(
        "--max-image-pixels",
        type=pixel_count,
        help="largest image decoded, width x height from its header (sets data.max_image_pixels)",
    )


def _index_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("export", help="export directory written by `ddp-rank export`")
    p.add_argument("--output", required=True, help="index directory to write")
    p.add_argument("--kind", choices=("flat", "ivfpq", "hnsw"), default="flat", help="flat = exact search")
    p.add_argument("--nlist", type=int, default=0, help="ivfpq: cells (0: from the collection size)")
    p.add_argument("--nprobe", type=int, default=16, help="ivfpq: cells visited per query")
    p.add_argument("--pq-m", type=int, default=0, help="ivfpq: sub-quantizers (0: from the dimension)")
    p.add_argument("--pq-bits", type=int, default=0, help="ivfpq: bits per code (0: 8, fewer for tiny sets)")
    p.add_argument("--hnsw-m", type=int, default=32, help="hnsw: links per node")
    p.add_argument("--ef-search", type=int, default=128, help="hnsw: candidates per query")
    p.add_argument("--recall-k", type=int, default=10, help="k of the recall measured against exact search")
    p.add_argument("--recall-queries", type=int, default=1000, help="queries of that measurement")


def _search_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("index", help="index directory written by `ddp-rank index`")
    p.add_argument("images", nargs="+", help="query image files or folders")
    p.add_argument("-k", type=int, default=5, help="results per query")
    p.add_argument("--checkpoint", help="default: the checkpoint the export was made with")
    p.add_argument("--config", help="default: the config the export was made with")
    p.add_argument(
        "--grid",
        metavar="PNG",
        help="also draw the queries and their top-k into this PNG, the hits read back from the export's source "
        "and captioned with their score and class name; a query file has no class, so each hit is framed green "
        "when it shares the class of the query's top-1 (framed grey), red otherwise (all grey for an unlabelled "
        "image-folder export), as the legend under them says",
    )
    add_on_bad(
        p, "skip", "a query that does not decode: leave it out with a line naming it (default) or stop at it"
    )
    p.add_argument(
        "--max-image-pixels",
        type=pixel_count,
        help="largest query image decoded, width x height from its header (default: the export's "
        "data.max_image_pixels)",
    )


def _fail(command: str, exc: Exception) -> int:
    print(f"ddp-rank {command}: error: {exc}", file=sys.stderr)
    return 2


def _errors() -> tuple[type[Exception], ...]:
    from ddp_rank.eval.export import ExportError
    from ddp_rank.eval.protocols import EvalError
    from ddp_rank.eval.sources import SourceError
    from ddp_rank.eval.vector_index import IndexBuildError
    from ddp_rank.model import CheckpointError, ModelError
    from ddp_rank.runtime import TrainError

    return (
        ConfigError,
        ModelError,
        CheckpointError,
        TrainError,
        EvalError,
        SourceError,
        IndexBuildError,
        ExportError,
        FileNotFoundError,
    )


def _run_export(args: argparse.Namespace) -> int:
    from ddp_rank.eval.workflow import describe_export, export_embeddings, load_run_config

    try:
        pixels = [] if args.max_image_pixels is None else [f"data.max_image_pixels={args.max_image_pixels}"]
        cfg = load_run_config(args.config, args.checkpoint, [*args.overrides, *pixels])
        manifest = export_embeddings(
            cfg, args.checkpoint, args.output, args.split, args.images, args.shards_url, args.on_bad
        )
        if manifest:  # rank 0
            print(describe_export(manifest, args.output))
    except _errors() as exc:
        return _fail("export", exc)
    return 0


def _run_index(args: argparse.Namespace) -> int:
    from ddp_rank.eval.export import load_export
    from ddp_rank.eval.vector_index import IndexSpec, SearchIndex

    try:
        spec = IndexSpec(
            args.kind, args.nlist, args.nprobe, args.pq_m, args.pq_bits, args.hnsw_m, ef_search=args.ef_search
        )
        built = SearchIndex.build(load_export(args.export), spec, args.recall_k, args.recall_queries)
        built.save(args.output)
    except _errors() as exc:
        return _fail("index", exc)
    info = built.info
    settings = ", ".join(
        f"{k}={v}" for k, v in info["spec"].items() if k != "kind" and _relevant(args.kind, k)
    )
    print(
        f"{args.kind} index of {info['rows']} embeddings (dim {info['dim']}){': ' + settings if settings else ''}"
    )
    print(
        f"recall@{info['recall_k']} against exact search: {built.recall:.4f} ({info['recall_queries']} queries, "
        f"{1e3 * info['search_seconds_per_query']:.3f} ms per query, built in {info['build_seconds']:.2f} s)"
    )
    print(f"index: {args.output}")
    return 0


def _relevant(kind: str, key: str) -> bool:
    return (kind == "ivfpq" and key in ("nlist", "nprobe", "pq_m", "pq_bits")) or (
        kind == "hnsw" and key in ("hnsw_m", "ef_construction", "ef_search")
    )


def _run_search(args: argparse.Namespace) -> int:
    from ddp_rank.eval.search import Searcher
    from ddp_rank.eval.sources import SourceError, list_images

    if args.k < 1:
        return _fail("search", ValueError(f"-k {args.k}: give the number of results per query, 1 or more"))
    try:
        paths = [
            p for item in args.images for p in (list_images(item) if Path(item).is_dir() else [Path(item)])
        ]
        searcher = Searcher.from_index(
            args.index, args.checkpoint, args.config, max_pixels=args.max_image_pixels
        )
        skipped: list[str] | None = [] if args.on_bad == "skip" else None
        paths, images = searcher.open_files(paths, skipped)
        for line in skipped or []:
            print(f"ddp-rank search: skipped {line}", file=sys.stderr)
        if not images:
            raise SourceError(f"no query image decodes ({len(skipped or [])} skipped)")
        results = searcher.search(images, args.k)
        indexed = len(searcher.index.items.keys)
        if args.k > indexed:
            print(
                f"ddp-rank search: -k {args.k} is more than the {indexed:,} items the index holds: each query "
                f"lists at most {indexed:,}",
                file=sys.stderr,
            )
    except _errors() as exc:
        return _fail("search", exc)
    except ValueError as exc:
        return _fail("search", exc)
    from ddp_rank.data.reading.shard_cache import open_cache
    from ddp_rank.eval.retrieval_captions import hit_line
    from ddp_rank.eval.retrieval_search_grid import draw_search_grid, export_images, hit_names

    problems: tuple[type[Exception], ...] = (OSError, ValueError, *_errors())
    source = searcher.index.info.get("export", {}).get("source", {})
    data, max_pixels = searcher.data, searcher.transform.max_pixels
    grid: Path | Exception | None = None
    try:  # one reader of the export's source: the hits' names, and their images for --grid
        fetch, close = export_images(source, max_pixels, open_cache(data.cache_dir, data.cache_max_gb))
    except problems as exc:
        fetch, close, grid = None, (lambda: None), exc if args.grid else None
        if source:  # an export of the user's own embeddings (save_export) records none: the ids, quietly
            print(f"ddp-rank search: the hits' class names and files are not shown: {exc}", file=sys.stderr)
    names = hit_names(fetch)  # the ids only where the source tells no names
    try:
        if fetch is not None and args.grid:  # first: a URL's scan for the picture reads the names too
            try:
                grid = draw_search_grid(paths, results, fetch, args.grid, max_pixels=max_pixels)
            except problems as exc:
                grid = exc
        for path, hits in zip(paths, results):
            print(f"{path}")
            for rank, hit in enumerate(hits, start=1):
                print(hit_line(rank, hit.score, hit.key, hit.label, hit.category, names(hit.label, hit.key)))
    finally:
        close()
    if isinstance(grid, Exception):
        return _fail("search", grid)
    if grid is not None:
        print(f"grid: {grid}")
    return 0


COMMANDS = (
    Command(
        "export",
        help="embed a split, an image folder or shards at a URL; write embeddings with keys, labels, categories",
        description="Embed every image of the source with a checkpoint; each process writes its part as .npz.",
        arguments=_export_arguments,
        run=_run_export,
    ),
    Command(
        "index",
        help="build a faiss index (flat, ivfpq, hnsw) from an export and print its recall against exact search",
        arguments=_index_arguments,
        run=_run_index,
    ),
    Command(
        "search",
        help="embed query images and print the top-k keys of an index, with their class names and source files",
        arguments=_search_arguments,
        run=_run_search,
    ),
)
