"""Data-layer throughput and planning cost, side by side in one run.

Writes synthetic photo-like JPEGs (``root/<category>/<class>/<image>``), builds shards from them, then pushes the
same images through four pipelines with the SAME decode and transform (ddp_rank's: PIL decode with JPEG draft,
one-resample resize + random resized crop + flip, uint8 per image, one normalisation per batch), batch size and
DataLoader worker count, alternating, and reports the median:

- ``ShardStream`` from the local directory (one ranged read per class, the global plan);
- ``ShardStream`` from a loopback HTTP server honouring Range requests (``ddp-rank shards serve``);
- a plain ``wds.WebDataset`` pipeline over the same tars (sequential reads, shuffle buffer);
- a torchvision ``ImageFolder`` over the source files.

Then the plan: construction time per step for a 65,536 global batch over an iNaturalist-sized catalog, and the
start-up of one process of a simulated 512 ranks x 8 workers job over 1,000 shards and 200,000 classes (every
process does the same work: load the manifest, build the plan, draw and deal the first step).

    .venv/bin/python -m benchmarks.data                        # 256 px and 800 px images, a few minutes on 2 cores
    .venv/bin/python -m benchmarks.data --sizes 256 --images 1200 --repeats 1
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader

from benchmarks.common import machine_description, markdown_table, write_result
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.format.manifest import ClassInfo, ClassSpan, Manifest, ShardInfo, SplitInfo
from ddp_rank.data.reading.batch import StreamBatch
from ddp_rank.data.reading.loader import StreamLoader
from ddp_rank.data.reading.serve import serve_directory
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import TransformConfig, decode_image, normalize_batch, train_transform
from ddp_rank.data.sampling.dealing import deal
from ddp_rank.data.sampling.plan import Catalog, GlobalPlan
from ddp_rank.data.sampling.schedule import ScheduleConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2400, help="images in each synthetic collection")
    p.add_argument("--sizes", default="256,800", help="sides of the generated JPEGs (one collection each)")
    p.add_argument("--categories", type=int, default=6)
    p.add_argument("--per-class", type=int, default=4, help="images per class")
    p.add_argument("--resize", type=int, default=256)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (and shard build workers)")
    p.add_argument("--max-samples", type=int, default=200, help="samples per shard")
    p.add_argument(
        "--repeats", type=int, default=3, help="alternating runs of each pipeline; the median counts"
    )
    p.add_argument("--skip-plan", action="store_true", help="only the pipelines")
    return p.parse_args()


def write_jpegs(root: Path, count: int, size: int, args: argparse.Namespace) -> None:
    """Smooth colour fields plus noise: JPEG sizes like photos, not like flat colour."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for c in range(count // args.per_class):
        folder = root / f"cat{c % args.categories}" / f"class{c:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.uniform(0, 255, size=(3, 3))
        for k in range(args.per_class):
            field = (
                base[:, 0, None, None] * xx + base[:, 1, None, None] * yy + base[:, 2, None, None] * (1 - xx)
            )
            noise = rng.normal(0, 12, size=(3, size, size))
            pixels = np.clip(field / 2 + noise + 40 * k, 0, 255).astype(np.uint8).transpose(1, 2, 0)
            Image.fromarray(pixels).save(folder / f"{k}.jpg", quality=90)


# ---------------------------------------------------------------------------------------------- pipelines


class SameTransform:
    """The per-image work every pipeline shares: bytes -> uint8 [3, crop, crop] (seeded per call by torch)."""

    def __init__(self, config: TransformConfig) -> None:
        self.config = config
        self.transform = train_transform(config)

    def __call__(self, data: bytes) -> torch.Tensor:
        return self.transform(decode_image(data, self.config.resize))


def collate(config: TransformConfig) -> Callable[[list[tuple[torch.Tensor, int]]], dict[str, Any]]:
    def fn(items: list[tuple[torch.Tensor, int]]) -> dict[str, Any]:
        return {
            "images": normalize_batch([x for x, _ in items], config),
            "labels": torch.tensor([y for _, y in items]),
        }

    return fn


def stream_loader(
    location: str, args: argparse.Namespace, steps: int, config: TransformConfig
) -> Iterable[Any]:
    stream = ShardStream(
        location,
        args.batch,
        num_workers=args.workers,
        schedule=ScheduleConfig(strategy="random", steps_per_epoch=None),
        transform=config,
        rank=0,
        world_size=1,
    )
    return StreamLoader(stream)


def wds_loader(shards: Path, args: argparse.Namespace, config: TransformConfig) -> Iterable[Any]:
    urls = sorted(str(p) for p in (shards / "train").glob("*.tar"))
    transform = SameTransform(config)
    dataset = (
        wds.WebDataset(
            urls, shardshuffle=len(urls), nodesplitter=wds.split_by_worker, empty_check=False, seed=0
        )
        .shuffle(500, seed=0)
        .to_tuple("jpg", "cls")
        .map_tuple(transform, lambda c: int(c))
    )
    return DataLoader(dataset, batch_size=args.batch, num_workers=args.workers, collate_fn=collate(config))


def folder_loader(images: Path, args: argparse.Namespace, config: TransformConfig) -> Iterable[Any]:
    transform = SameTransform(config)
    dataset = torchvision.datasets.ImageFolder(
        str(images), loader=lambda p: Path(p).read_bytes(), transform=transform
    )
    return DataLoader(
        dataset,
        batch_size=args.batch,
        shuffle=True,
        num_workers=args.workers,
        drop_last=True,
        collate_fn=collate(config),
    )


def timed(loader: Iterable[Any], total: int) -> dict[str, float]:
    """Images per second counted from the end of the first batch (start-up reported separately)."""
    start = time.perf_counter()
    seen, first, steady_start = 0, 0.0, start
    iterator: Iterator[Any] = iter(loader)
    for batch in iterator:
        n = len(batch) if isinstance(batch, StreamBatch) else batch["images"].shape[0]
        if not first:
            first = time.perf_counter() - start
            steady_start = time.perf_counter()
        else:
            seen += n
        if seen + n > total:
            break
    return {"img_s": seen / (time.perf_counter() - steady_start), "first_batch_s": first}


def bench_pipelines(size: int, work: Path, args: argparse.Namespace) -> list[list[str]]:
    images, shards = work / f"images{size}", work / f"shards{size}"
    write_jpegs(images, args.images, size, args)
    t0 = time.perf_counter()
    build_shards(
        read_image_folder(images),
        shards,
        BuildOptions(max_samples=args.max_samples, workers=args.workers, progress=False),
    )
    build_s = time.perf_counter() - t0
    config = TransformConfig(resize=args.resize, crop=args.crop)
    total = args.images - 2 * args.batch
    runs: dict[str, list[dict[str, float]]] = {"stream": [], "http": [], "wds": [], "folder": []}
    with serve_directory(shards) as url:
        for _ in range(args.repeats):
            runs["stream"].append(timed(stream_loader(str(shards), args, total // args.batch, config), total))
            runs["http"].append(timed(stream_loader(url, args, total // args.batch, config), total))
            runs["wds"].append(timed(wds_loader(shards, args, config), total))
            runs["folder"].append(timed(folder_loader(images, args, config), total))
    median = {k: statistics.median(r["img_s"] for r in v) for k, v in runs.items()}
    names = {
        "stream": "ShardStream, local directory",
        "http": "ShardStream, loopback HTTP (Range)",
        "wds": "wds.WebDataset pipeline",
        "folder": "torchvision ImageFolder",
    }
    rows = [[f"{size} px", "shard build", f"{args.images / build_s:.0f}", "", ""]]
    for key, name in names.items():
        first = statistics.median(r["first_batch_s"] for r in runs[key])
        rows.append(
            [
                f"{size} px",
                name,
                f"{median[key]:.0f}",
                f"{median[key] / median['folder']:.2f}x",
                f"runs {[round(r['img_s']) for r in runs[key]]}, first batch {first:.2f} s",
            ]
        )
    rows.append(
        [f"{size} px", "HTTP / local stream", f"{median['http'] / median['stream']:.2f}x", "", "goal >= 0.8x"]
    )
    return rows


# ---------------------------------------------------------------------------------------------- planning


def inat_like_catalog(seed: int = 0) -> Catalog:
    """5,690 classes, 325,846 images, 13 categories, long-tailed: the Smooth-AP iNaturalist train split's size."""
    rng = np.random.default_rng(seed)
    share = np.array([2, 15, 5, 5, 214, 0.4, 6, 100, 29, 8, 158, 0.3, 35], dtype=float)
    groups = rng.choice(13, size=5_690, p=share / share.sum())
    sizes = np.clip(np.round(rng.lognormal(3.6, 0.9, size=5_690)), 2, 1_000).astype(int)
    return Catalog.of(
        dict(enumerate(sizes.tolist())), dict(enumerate(groups.tolist())), [f"c{i}" for i in range(13)]
    )


def bench_plan_step() -> list[list[str]]:
    rows = []
    for strategy in ("hard", "random", "pk"):
        # pk with K = 16: 5,690 classes x 4 images would not fill one batch of 65,536
        config = ScheduleConfig(strategy=strategy, batches_per_pair=2, images_per_class=16, seed=0)
        plan = GlobalPlan(inat_like_catalog(), config, 65_536)
        steps = min(plan.steps_per_epoch, 12)
        t0 = time.perf_counter()
        plans = [plan.step(0, s) for s in range(steps)]
        per_step = (time.perf_counter() - t0) / steps
        t0 = time.perf_counter()
        for one in plans:
            deal(one, 64)
        per_deal = (time.perf_counter() - t0) / steps
        rows.append(
            [
                f"plan, M = 65,536, {strategy}",
                f"{1000 * per_step:.1f} ms",
                f"deal to 64 ranks {1000 * per_deal:.1f} ms",
                "goal < 10 ms",
            ]
        )
    return rows


def big_manifest(directory: Path, shards: int = 1_000, classes: int = 200_000) -> Path:
    rng = np.random.default_rng(1)
    sizes = rng.integers(2, 12, size=classes)
    categories = 20
    infos, per_shard = [], classes // shards
    for i in range(shards):
        spans, offset = [], 0
        for cid in range(i * per_shard, (i + 1) * per_shard):
            n = int(sizes[cid])
            spans.append(ClassSpan(cid, n, offset, n * 30_000, "0" * 32))
            offset += n * 30_000
        infos.append(
            ShardInfo(
                f"train/s{i:05d}.tar",
                i % categories,
                tuple(spans),
                sum(s.count for s in spans),
                offset,
                "0" * 64,
            )
        )
    manifest = Manifest(
        tuple(f"cat{c}" for c in range(categories)),
        tuple(ClassInfo(c, f"class{c}", (c // per_shard) % categories) for c in range(classes)),
        {"train": SplitInfo("train", {c: int(n) for c, n in enumerate(sizes)}, tuple(infos))},
    )
    directory.mkdir(parents=True, exist_ok=True)
    manifest.save(directory)
    return directory


def bench_startup(work: Path) -> list[list[str]]:
    directory = big_manifest(work / "big")
    timings = []
    for rank in (0, 511):  # every rank and worker does the same work; two ranks shown
        t0 = time.perf_counter()
        manifest = Manifest.load(directory)
        t1 = time.perf_counter()
        plan = GlobalPlan(
            Catalog.from_manifest(manifest, "train"), ScheduleConfig(batches_per_pair=1, seed=0), 65_536
        )
        part = deal(plan.step(0, 0), 512)[rank]
        t2 = time.perf_counter()
        timings.append((t1 - t0, t2 - t1, sum(p.size for p in part)))
    load, build, local = timings[-1]
    return [
        [
            "start-up, 512 ranks x 8 workers, 1,000 shards, 200,000 classes",
            f"{load + build:.2f} s per process",
            f"manifest {load:.2f} s + plan and first step {build:.2f} s; {local} images for rank 511",
            "goal < 5 s",
        ]
    ]


def main() -> None:
    args = parse_args()
    work = Path(tempfile.mkdtemp(prefix="ddp_rank_bench_"))
    try:
        pipeline_rows = [
            row
            for size in (int(s) for s in args.sizes.split(","))
            for row in bench_pipelines(size, work, args)
        ]
        body = [
            f"Command: `python -m benchmarks.data --images {args.images} --sizes {args.sizes} --workers {args.workers} "
            f"--batch {args.batch} --repeats {args.repeats}`",
            "",
            f"{args.images} synthetic JPEGs per size (quality 90), {args.per_class} per class, {args.categories} "
            f"categories; the same decode and transform in every pipeline (resize {args.resize}, random resized crop "
            f"{args.crop}, flip, normalise per batch); batch {args.batch}; {args.workers} DataLoader workers; images/s "
            f"after the first batch, median of {args.repeats} alternating runs.",
            "",
            markdown_table(["images", "pipeline", "images/s", "vs ImageFolder", "notes"], pipeline_rows),
        ]
        if not args.skip_plan:
            plan_rows = bench_plan_step() + bench_startup(work)
            body += ["", markdown_table(["planning", "time", "detail", "target"], plan_rows)]
        text = "\n".join(body)
        print(f"Machine: {machine_description()}\n\n{text}")
        print(f"written to {write_result('data', 'Data layer: pipelines and planning', text)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
