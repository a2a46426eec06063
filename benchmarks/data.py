"""Data-layer throughput: shard build, and the stream against a plain torchvision ImageFolder DataLoader.

Writes a synthetic image folder (JPEGs, ``root/<category>/<class>/<image>``), builds shards from it, then pushes
the same images through (a) ``ShardStream`` + ``StreamLoader`` and (b) ``ImageFolder`` + ``DataLoader`` with the
same transforms (resize, random resized crop, flip, normalise), batch size and worker count, one after the other
in the same run. Prints a table and writes ``benchmarks/results/data-<date>.md`` naming the machine.

    .venv/bin/python benchmarks/data.py                  # defaults: about a minute on 2 cores
    .venv/bin/python benchmarks/data.py --images 20000 --workers 8 --size 400
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader
from torchvision.transforms import v2

from ddp_rank.data.build import BuildOptions, build_shards
from ddp_rank.data.listing import read_image_folder
from ddp_rank.data.loader import StreamLoader
from ddp_rank.data.schedule import ScheduleConfig
from ddp_rank.data.stream import ShardStream
from ddp_rank.data.transforms import IMAGENET_MEAN, IMAGENET_STD, TransformConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=2400, help="images in the synthetic collection")
    p.add_argument("--categories", type=int, default=6)
    p.add_argument("--per-class", type=int, default=4, help="images per class")
    p.add_argument("--size", type=int, default=256, help="side of the generated JPEGs")
    p.add_argument("--resize", type=int, default=256)
    p.add_argument("--crop", type=int, default=224)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (and shard build workers)")
    p.add_argument("--max-samples", type=int, default=200, help="samples per shard")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="alternating runs of each loader; the median is reported (shared machines are noisy)",
    )
    p.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    p.add_argument(
        "--keep", type=Path, default=None, help="work directory to keep (default: a temporary one)"
    )
    return p.parse_args()


def write_jpegs(root: Path, args: argparse.Namespace) -> int:
    """Smooth colour fields plus noise: JPEG sizes like photos (tens of KB at 256 px), not like flat colour."""
    rng = np.random.default_rng(0)
    classes = args.images // args.per_class
    yy, xx = np.mgrid[0 : args.size, 0 : args.size].astype(np.float32) / args.size
    n = 0
    for c in range(classes):
        folder = root / f"cat{c % args.categories}" / f"class{c:05d}"
        folder.mkdir(parents=True, exist_ok=True)
        base = rng.uniform(0, 255, size=(3, 3))
        for k in range(args.per_class):
            field = (
                base[:, 0, None, None] * xx + base[:, 1, None, None] * yy + base[:, 2, None, None] * (1 - xx)
            )
            noise = rng.normal(0, 12, size=(3, args.size, args.size))
            pixels = np.clip(field / 2 + noise + 40 * k, 0, 255).astype(np.uint8).transpose(1, 2, 0)
            Image.fromarray(pixels).save(folder / f"{k}.jpg", quality=90)
            n += 1
    return n


def bench_build(images: Path, out: Path, args: argparse.Namespace) -> dict[str, float]:
    records = read_image_folder(images)
    megabytes = sum(os.path.getsize(r.path) for r in records) / 2**20
    start = time.perf_counter()
    build_shards(
        records, out, BuildOptions(max_samples=args.max_samples, workers=args.workers, progress=False)
    )
    seconds = time.perf_counter() - start
    return {
        "images": len(records),
        "seconds": seconds,
        "img_s": len(records) / seconds,
        "mb_s": megabytes / seconds,
    }


def timed(loader: object, total: int, images_key: str | int) -> dict[str, float]:
    """Images per second, counted from the end of the first batch (worker start-up reported separately)."""
    start = time.perf_counter()
    seen = 0
    first = 0.0
    for batch in loader:  # type: ignore[attr-defined]
        images = batch[images_key]
        if not first:
            first = time.perf_counter() - start
            steady_start = time.perf_counter()
        else:
            seen += images.shape[0]
        if seen + images.shape[0] > total:
            break
    steady = time.perf_counter() - steady_start
    return {"img_s": seen / steady, "first_batch_s": first, "images": seen}


def bench_stream(shards: Path, args: argparse.Namespace, total: int) -> dict[str, float]:
    steps = total // args.batch
    stream = ShardStream(
        shards,
        args.batch,
        num_workers=args.workers,
        schedule=ScheduleConfig(steps_per_epoch=steps),
        transform=TransformConfig(resize=args.resize, crop=args.crop),
        rank=0,
        world_size=1,
    )
    return timed(StreamLoader(stream), total, "images")


def bench_imagefolder(images: Path, args: argparse.Namespace, total: int) -> dict[str, float]:
    transform = v2.Compose(
        [
            v2.Resize(args.resize, antialias=True),
            v2.RandomResizedCrop(args.crop, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )
    dataset = torchvision.datasets.ImageFolder(str(images), transform=transform)
    loader = DataLoader(
        dataset, batch_size=args.batch, shuffle=True, num_workers=args.workers, drop_last=True
    )
    return timed(loader, total, 0)


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median rate, with every run's rate attached for the record."""
    ordered = sorted(runs, key=lambda r: r["img_s"])
    return {**ordered[len(ordered) // 2], "all": [round(r["img_s"]) for r in runs]}  # type: ignore[dict-item]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def report(
    args: argparse.Namespace, build: dict[str, float], stream: dict[str, float], folder: dict[str, float]
) -> str:
    ratio = stream["img_s"] / folder["img_s"]
    machine = (
        f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, torchvision "
        f"{torchvision.__version__}, Python {platform.python_version()}"
    )
    rows = [
        "| measurement | images/s | notes |",
        "|---|---|---|",
        f"| shard build ({args.workers} workers) | {build['img_s']:.0f} | {build['mb_s']:.1f} MB/s, "
        f"{build['images']:.0f} images in {build['seconds']:.1f} s |",
        f"| ShardStream + StreamLoader | {stream['img_s']:.0f} | runs {stream['all']}, first batch after "
        f"{stream['first_batch_s']:.2f} s |",
        f"| ImageFolder + DataLoader | {folder['img_s']:.0f} | runs {folder['all']}, first batch after "
        f"{folder['first_batch_s']:.2f} s |",
        f"| ratio stream / ImageFolder | {ratio:.2f}x | goal >= 0.9x |",
    ]
    return "\n".join(
        [
            f"# Data-layer benchmark, {datetime.date.today().isoformat()}",
            "",
            f"Machine: {machine}.",
            f"Setup: {args.images} synthetic {args.size}x{args.size} JPEGs (quality 90), {args.per_class} per class, "
            f"{args.categories} categories; transforms resize {args.resize}, random resized crop {args.crop}, flip, "
            f"normalise; batch {args.batch}; {args.workers} DataLoader workers; steady-state rate after the first batch; "
            f"median of {args.repeats} alternating runs (load average at the end: {os.getloadavg()[0]:.1f}).",
            f"Command: `python benchmarks/data.py --images {args.images} --workers {args.workers} --batch {args.batch} "
            f"--repeats {args.repeats}`",
            "",
            *rows,
            "",
        ]
    )


def main() -> None:
    args = parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ddp_rank_bench_"))
    try:
        images = work / "images"
        if not images.exists():
            write_jpegs(images, args)
        shards = work / "shards"
        shutil.rmtree(shards, ignore_errors=True)
        build = bench_build(images, shards, args)
        total = build["images"]
        runs: dict[str, list[dict[str, float]]] = {"stream": [], "folder": []}
        for _ in range(args.repeats):
            runs["stream"].append(bench_stream(shards, args, int(total)))
            runs["folder"].append(bench_imagefolder(images, args, int(total)))
        stream, folder = median_run(runs["stream"]), median_run(runs["folder"])
        text = report(args, build, stream, folder)
        print(text)
        args.results.mkdir(parents=True, exist_ok=True)
        out = args.results / f"data-{datetime.date.today().isoformat()}.md"
        out.write_text(text)
        print(f"written to {out}")
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
