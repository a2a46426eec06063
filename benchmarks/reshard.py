"""``ddp-rank shards reshard`` on a shuffled set: throughput and peak memory, against the memory setting and the
dataset's size.

Writes photo-like JPEGs with ``webdataset.ShardWriter`` in shuffled order (``maxcount`` samples per tar, about one
span per image once indexed), indexes them in place, then reshards them into the project's layout, each
configuration in a fresh process: once timed (images/s, MB/s of source bytes) and once under ``tracemalloc``
(the peak of Python's heap during the reshard: the sample bytes held) with the process's peak RSS growth over
its start (``ru_maxrss``). Sources: the local directory, and the same directory over HTTP (``shards serve``'s
loopback server, concurrent range requests). The claim to check: peak memory follows ``--memory-mb``, not the
number of samples.

    .venv/bin/python -m benchmarks.reshard                          # 1,500 and 3,000 samples, a few minutes
    .venv/bin/python -m benchmarks.reshard --samples 3000 --memory-mb 2,32 --no-http
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import resource
import shutil
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import webdataset as wds
from PIL import Image

from benchmarks.common import machine_description, markdown_table, write_result
from ddp_rank.data.building.reshard import ReshardOptions, reshard
from ddp_rank.data.building.shard_index import IndexOptions, find_splits, index_shards
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.serve import serve_directory


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", default="1500,3000", help="dataset sizes (one shuffled set each)")
    p.add_argument("--size", type=int, default=96, help="side of the generated JPEGs")
    p.add_argument("--per-class", type=int, default=6, help="images per class")
    p.add_argument("--categories", type=int, default=5)
    p.add_argument("--maxcount", type=int, default=200, help="samples per source tar (ShardWriter maxcount)")
    p.add_argument("--memory-mb", default="1,16", help="reshard --memory-mb settings to compare")
    p.add_argument("--max-samples", type=int, default=500, help="reshard --max-samples")
    p.add_argument("--no-http", action="store_true", help="only the local source")
    return p.parse_args()


def write_shuffled(root: Path, samples: int, args: argparse.Namespace) -> int:
    """A shuffled set by ShardWriter (class in .cls, category in the json); returns its bytes."""
    rng = np.random.default_rng(0)
    classes = max(1, samples // args.per_class)
    order = rng.permutation(samples)
    root.mkdir(parents=True)
    with wds.ShardWriter(str(root / "part-%05d.tar"), maxcount=args.maxcount, verbose=0) as sink:
        for n in order:
            cls = int(n) % classes
            base = np.full((args.size, args.size, 3), (cls * 37) % 256, dtype=np.uint8)
            pixels = np.clip(base + rng.integers(0, 64, size=base.shape), 0, 255).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
            sink.write(
                {
                    "__key__": f"s{int(n):07d}",
                    "jpg": buf.getvalue(),
                    "cls": f"class{cls}",
                    "json": json.dumps({"family": f"cat{cls % args.categories}"}),
                }
            )
    index_shards(root, find_splits(root, []), IndexOptions(category_field="family")).manifest.save(root)
    return sum(p.stat().st_size for p in root.glob("*.tar"))


def _child(source: str, out: str, options: ReshardOptions, traced: bool, queue: Any) -> None:
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if traced:
        tracemalloc.start()
    t0 = time.perf_counter()
    reshard(source, out, options)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] if traced else 0
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start_rss
    queue.put((seconds, peak, grown * 1024))


def run_once(source: str, out: Path, options: ReshardOptions, traced: bool) -> tuple[float, int, int]:
    """One reshard in a fresh process (spawned: no memory inherited): (seconds, heap peak, RSS growth)."""
    shutil.rmtree(out, ignore_errors=True)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(source, str(out), options, traced, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result  # type: ignore[no-any-return]


def main() -> None:
    args = parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp_rank-bench-reshard-") as tmp:
        work = Path(tmp)
        for samples in (int(s) for s in args.samples.split(",")):
            src = work / f"src-{samples}"
            nbytes = write_shuffled(src, samples, args)
            manifest = Manifest.load(src)
            spans = sum(len(s.classes) for s in manifest.split("train").shards)
            sources = [("local", str(src))]
            for memory_mb in (float(m) for m in args.memory_mb.split(",")):
                options = ReshardOptions(
                    max_samples=args.max_samples, memory_bytes=int(memory_mb * 2**20), progress=False
                )
                for where, location in sources + ([] if args.no_http else [("http", "")]):
                    with serve_directory(src) if where == "http" else _nothing() as url:
                        at = url or location
                        seconds, _, _ = run_once(at, work / "out", options, traced=False)
                        _, peak, grown = run_once(at, work / "out", options, traced=True)
                    rows.append(
                        [
                            f"{samples:,}",
                            f"{spans:,}",
                            f"{nbytes / 2**20:.1f}",
                            where,
                            f"{memory_mb:g}",
                            f"{samples / seconds:,.0f}",
                            f"{nbytes / 2**20 / seconds:.2f}",
                            f"{peak / 2**20:.1f}",
                            f"{grown / 2**20:.1f}",
                        ]
                    )
                    print(" | ".join(rows[-1]), flush=True)
    header = [
        "samples", "source spans", "source MB", "source", "--memory-mb", "images/s", "MB/s",
        "heap peak MB", "RSS growth MB",
    ]  # fmt: skip
    body = (
        f"Shuffled JPEGs of {args.size} px by webdataset.ShardWriter (maxcount {args.maxcount}), {args.per_class} "
        f"images per class, {args.categories} categories, indexed in place; reshard --max-samples "
        f"{args.max_samples}; each reshard in a fresh process, the final verification included.\n\n"
        + markdown_table(header, rows)
    )
    path = write_result("reshard", "Reshard: throughput and peak memory on a shuffled set", body)
    print(f"\n{machine_description()}\nwrote {path}")


class _nothing:
    def __enter__(self) -> str:
        return ""

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    main()
