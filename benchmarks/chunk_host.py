"""The chunked step's host cost per chunk: operations dispatched, host reads, and host time, on a small model.

At 32-64 images a chunk, a GPU runs a chunk of ResNet-50 in a few milliseconds; what the host does per chunk
(Python, operator dispatch, and above all any wait for the GPU) then decides the step's speed. This measures, on
the CPU, the chunked step (``ddp_rank.train.forward_backward``) of a small convolutional ``EmbeddingNet`` fed
uint8 images, channels-last, frozen BatchNorm, bfloat16 autocast (the trainer's GPU setup), for 2, 4 and 8
chunks of one batch:

- operations: every ATen operation dispatched in the step, forward and backward (a ``TorchDispatchMode``);
- host reads: calls that bring a tensor's value to the host, each a wait for the GPU on a GPU
  (``benchmarks/acceptance/host_syncs.py``);
- host time: the step's median CPU time (``time.process_time``, one thread; on the CPU the compute is host time
  too, so the images are small), which a loaded machine does not inflate as it does wall time.

"Per chunk" is the slope from 2 to 8 chunks (the same images, cut finer), so what every step pays once (the
loss, the concatenation) drops out.

    python -m benchmarks.chunk_host [--rows 64 --image-size 8 --repeats 20] [--json OUT.json]
    python -m benchmarks.chunk_host --baseline OLD.json   # adds the figures of another checkout beside these

To compare with older code, run this script in a checkout of it (copy this checkout's ``benchmarks/`` folder
there: the script, ``common.py`` and ``acceptance/host_syncs.py``) with ``--json OLD.json --no-write``, then here
with ``--baseline OLD.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.acceptance.host_syncs import count_host_syncs
from benchmarks.common import markdown_table, write_result
from ddp_rank.model.net import EmbeddingNet, TinyCNN, freeze_batchnorm
from ddp_rank.train import PlainBackend, forward_backward

REPO = Path(__file__).resolve().parent.parent
CHUNKS = (2, 4, 8)


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _loss(embeddings: Tensor, labels: Tensor) -> Tensor:
    """A loss that reads nothing on the host: the step's own cost is what is measured."""
    same = (labels[:, None] == labels[None, :]).float()
    return ((embeddings @ embeddings.T - same) ** 2).mean()


def build(rows: int, image_size: int) -> tuple[EmbeddingNet, Tensor, Tensor]:
    torch.manual_seed(0)
    net = EmbeddingNet(TinyCNN((8, 16, 32, 64)), 64, 32).use_channels_last()
    freeze_batchnorm(net)
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (rows, 3, image_size, image_size), dtype=torch.uint8, generator=g)
    return net, images, torch.arange(rows) % 8


def measure(rows: int, image_size: int, repeats: int) -> dict[int, dict[str, float]]:
    """For each chunk count: operations and host reads of one step, and its median CPU time in seconds."""
    net, images, labels = build(rows, image_size)
    backend = PlainBackend(net, autocast_dtype=torch.bfloat16)

    def step(chunks: int) -> None:
        forward_backward(backend, images, labels, _loss, chunk_size=rows // chunks)
        net.zero_grad(set_to_none=True)

    out: dict[int, dict[str, float]] = {}
    for chunks in CHUNKS:
        for _ in range(3):
            step(chunks)
        with _CountOps() as ops:
            step(chunks)
        with count_host_syncs() as syncs:
            step(chunks)
        times = []
        for _ in range(repeats):
            start = time.process_time()
            step(chunks)
            times.append(time.process_time() - start)
        out[chunks] = {"ops": ops.count, "syncs": syncs.total, "time_s": statistics.median(times)}
        print(f"{chunks} chunks: {out[chunks]}", flush=True)
    return out


def per_chunk(figures: dict[int, dict[str, float]], key: str) -> float:
    low, high = min(CHUNKS), max(CHUNKS)
    return (figures[high][key] - figures[low][key]) / (high - low)


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(figures: dict[str, dict[int, dict[str, float]]]) -> str:
    """One row per code version and chunk count, then the per-chunk slopes."""
    rows = []
    for label, by_chunks in figures.items():
        for chunks, f in by_chunks.items():
            rows.append(
                [label, str(chunks), f"{f['ops']:.0f}", f"{f['syncs']:.0f}", f"{1e3 * f['time_s']:.2f} ms"]
            )
        rows.append(
            [
                label,
                "**per chunk**",
                f"**{per_chunk(by_chunks, 'ops'):.1f}**",
                f"**{per_chunk(by_chunks, 'syncs'):.1f}**",
                f"**{1e3 * per_chunk(by_chunks, 'time_s'):.2f} ms**",
            ]
        )
    return markdown_table(["code", "chunks", "operations / step", "host reads / step", "step CPU time"], rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="images in the batch (a multiple of 8)")
    p.add_argument("--image-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20, help="timed steps per chunk count (median)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--baseline", type=Path, help="figures of another checkout (its --json), shown first")
    p.add_argument("--label", default=None, help="this code's name in the table (default: its commit)")
    p.add_argument("--no-write", action="store_true", help="no results markdown (a baseline run)")
    args = p.parse_args(argv)
    if args.rows % max(CHUNKS):
        p.error(f"--rows must be a multiple of {max(CHUNKS)}, got {args.rows}")
    torch.set_num_threads(1)
    label = args.label or f"commit {_commit()}"
    figures = measure(args.rows, args.image_size, args.repeats)
    if args.json:
        args.json.write_text(json.dumps({"label": label, "figures": figures}, indent=1))
    shown: dict[str, dict[int, dict[str, float]]] = {}
    if args.baseline:
        base = json.loads(args.baseline.read_text())
        shown[base["label"]] = {int(k): v for k, v in base["figures"].items()}
    shown[label] = figures
    text = table(shown)
    print(text)
    if not args.no_write:
        command = f"python -m benchmarks.chunk_host --rows {args.rows} --image-size {args.image_size} --repeats {args.repeats}"
        body = (
            f"Command: `{command}{' --baseline OLD.json' if args.baseline else ''}`\n\n"
            f"The chunked step of a small convolutional EmbeddingNet (TinyCNN 8-16-32-64, head 32), {args.rows} uint8 "
            f"images of {args.image_size} px, channels-last, frozen BatchNorm, bfloat16 autocast, one CPU thread; "
            "operations: ATen operations dispatched (forward and backward); host reads: calls that bring a value "
            "to the host (each a wait for the GPU on a GPU); time: median CPU time of a step. Per chunk: the slope from "
            f"{min(CHUNKS)} to {max(CHUNKS)} chunks.\n\n{text}"
        )
        print(f"written to {write_result('chunk-host', 'The chunked step: host cost per chunk', body)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
