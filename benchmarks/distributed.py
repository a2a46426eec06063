"""Benchmark the distributed layer: GlobalBatchLoss against pytorch-metric-learning, and the chunked step.

Part 1 (2 gloo processes on this machine, one thread each): per-step time (forward + backward of the loss on
random unit embeddings), peak extra memory per rank and bytes each rank sends, for

- ours: ``GlobalBatchLoss(FastAPLoss())``: N_local x N rows per rank, all-gather + reduce-scatter;
- PML: ``pytorch_metric_learning.utils.distributed.DistributedLossWrapper(FastAPLoss())``: all-gather, then
  the whole N x N loss on every rank (its FastAP also materialises [bins, N, N]);
- ours, generic path: ``GlobalBatchLoss(pytorch_metric_learning.losses.FastAPLoss())``, how any other loss goes
  global (the whole loss on the gathered batch on every rank, autograd through this rank's rows): the same loss
  code as PML's wrapper, so the difference is the wrapper's.

Part 2 (one process): the chunked step's time over the direct step on a small CNN (goal: at most 1.4x, the
cost of the second forward).

Bytes are counted with the ring convention of ``ddp_rank.distributed.collectives`` (what one rank sends):
ours from the helpers' counter, PML's analytically from the tensors its ``all_gather`` moves. The gradient
all-reduce of the model (identical for both) is not included. Peak memory is the largest resident set size
sampled every 2 ms during the step, minus the resident size just before it (large buffers are returned to
the OS at free: the children run with MALLOC_MMAP_THRESHOLD_=65536).

    .venv/bin/python -m benchmarks.distributed                  # defaults: a few minutes on 2 cores
    .venv/bin/python -m benchmarks.distributed --sizes 1024 32768 --pml-max 2048
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

RESULTS = Path(__file__).parent / "results"
WORLD = 2
# PML's FastAP keeps about this many float32 [N, N] buffers alive at its peak (bins + 1 pulses, masks, their
# gradients; measured: 2.9 GiB at N = 4096), used to report the sizes it cannot reach instead of running out
# of memory.
PML_NN_BUFFERS = 46


# ------------------------------------------------------------------------------------------- measurement
@contextmanager
def peak_rss() -> Any:
    """Yields a dict whose "bytes" is, on exit, the peak resident memory above the level at entry."""
    process, result, stop = psutil.Process(), {"bytes": 0}, threading.Event()
    base = process.memory_info().rss
    peak = [base]

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result["bytes"] = max(peak[0], process.memory_info().rss) - base


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{model}, {os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB RAM, "
        f"torch {torch.__version__}, Python {platform.python_version()}; load average at start {load} "
        "(other jobs share the machine: wall times include waiting for a core, CPU times do not)"
    )


# ----------------------------------------------------------------------------------------- part 1: losses
def global_batch(n_global: int, dim: int, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's half of a global batch of classes of 4 (global class ids), unit rows."""
    g = torch.Generator().manual_seed(seed)
    embeddings = torch.nn.functional.normalize(torch.randn(n_global, dim, generator=g), dim=1)
    labels = torch.arange(n_global) // 4
    rows = slice(rank * n_global // WORLD, (rank + 1) * n_global // WORLD)
    return embeddings[rows].contiguous(), labels[rows].contiguous()


def pml_bytes(n_global: int, dim: int) -> int:
    """PML all-gathers the embeddings (float32) and the labels (int64): ring bytes one rank sends."""
    return round((WORLD - 1) / WORLD * n_global * (dim * 4 + 8))


METHODS = {
    "ours": "GlobalBatchLoss (ours), fp32 inputs",
    "ours-bf16": "GlobalBatchLoss (ours), bf16 inputs",
    "ours-bf16-grads": "GlobalBatchLoss (ours), bf16 inputs and gradients",
    "pml": "PML DistributedLossWrapper",
    "ours-generic": "GlobalBatchLoss (ours), generic path, PML's FastAP",
}
NN_METHODS = ("pml", "ours-generic")
"""The methods that compute the whole N x N loss on every rank (run up to --pml-max only)."""


def make_loss(method: str, counter: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if method.startswith("ours") and method != "ours-generic":
        from ddp_rank.distributed import GlobalBatchLoss
        from ddp_rank.losses import FastAPLoss

        grad_dtype = torch.bfloat16 if method == "ours-bf16-grads" else None
        return GlobalBatchLoss(
            FastAPLoss(num_bins=10, normalize=False), comm_counter=counter, grad_dtype=grad_dtype
        )
    from pytorch_metric_learning.losses import FastAPLoss as PMLFastAP
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

    if method == "ours-generic":
        from ddp_rank.distributed import GlobalBatchLoss

        return GlobalBatchLoss(PMLFastAP(num_bins=10), comm_counter=counter)
    return DistributedLossWrapper(PMLFastAP(num_bins=10))


def time_loss(method: str, n_global: int, dim: int, repeats: int, rank: int) -> dict[str, float]:
    from ddp_rank.distributed import CommCounter

    counter = CommCounter()
    loss_fn = make_loss(method, counter)
    local, labels = global_batch(n_global, dim, rank)
    if "bf16" in method:
        local = local.bfloat16()
    loss_fn(local.clone().requires_grad_(), labels).backward()  # warm-up: lazy initialisation, first buffers
    times, cpu, peaks = [], [], []
    for _ in range(repeats):
        counter.reset()
        e = local.clone().requires_grad_()
        dist.barrier()
        with peak_rss() as mem:
            start, start_cpu = time.perf_counter(), time.process_time()
            loss_fn(e, labels).backward()
            cpu.append(time.process_time() - start_cpu)
            dist.barrier()
            times.append(time.perf_counter() - start)
        peaks.append(mem["bytes"])
    sent = counter.total if method.startswith("ours") else pml_bytes(n_global, dim)
    return {"time": min(times), "cpu": min(cpu), "peak": max(peaks), "bytes": sent}


def loss_worker(
    rank: int, port: int, sizes: list[int], pml_max: int, dim: int, repeats: int, queue: Any
) -> None:
    from ddp_rank.distributed import end_process_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=None, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(minutes=10))
    rows = []
    for n_global in sizes:
        for method in METHODS:
            if method in NN_METHODS and n_global > pml_max:
                rows.append({"method": method, "n": n_global, "skipped": True})
                continue
            stats = time_loss(method, n_global, dim, repeats, rank)
            gathered: list[Any] = [None] * WORLD
            dist.all_gather_object(gathered, stats)
            rows.append({key: max(s[key] for s in gathered) for key in ("time", "cpu", "peak", "bytes")})
            rows[-1].update(method=method, n=n_global)
            if rank == 0:
                print(f"  {method:4s} N={n_global:6d}: {rows[-1]['time']:.3f} s", flush=True)
    if rank == 0:
        queue.put(rows)
    end_process_group()


def run_loss_benchmark(sizes: list[int], pml_max: int, dim: int, repeats: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=loss_worker, args=(r, store.port, sizes, pml_max, dim, repeats, queue))
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    rows = queue.get()
    for p in procs:
        p.join()
    return rows


# ------------------------------------------------------------------------------------ part 2: chunked step
def small_cnn(dim: int) -> nn.Module:
    """A small CNN without BatchNorm (direct and chunked compute the same function), with dropout to exercise RNG
    replay."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.1),
        nn.Linear(128, dim),
    )


def chunked_worker(batch: int, chunk: int, image: int, dim: int, repeats: int, queue: Any) -> None:
    from ddp_rank.losses import FastAPLoss
    from ddp_rank.train import PlainBackend, forward_backward

    torch.set_num_threads(1)
    model = small_cnn(dim)
    backend, loss = PlainBackend(model), FastAPLoss()
    inputs = torch.randn(batch, 3, image, image)
    labels = torch.arange(batch) // 4
    result = {}
    for name, chunk_size in (("direct", None), ("chunked", chunk)):
        forward_backward(backend, inputs, labels, loss, chunk_size)  # warm-up
        times, cpu, peaks = [], [], []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            with peak_rss() as mem:
                start, start_cpu = time.perf_counter(), time.process_time()
                forward_backward(backend, inputs, labels, loss, chunk_size)
                cpu.append(time.process_time() - start_cpu)
                times.append(time.perf_counter() - start)
            peaks.append(mem["bytes"])
        result[name] = {"time": min(times), "cpu": min(cpu), "peak": max(peaks)}
    queue.put(result)


def run_chunked_benchmark(batch: int, chunk: int, image: int, dim: int, repeats: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=chunked_worker, args=(batch, chunk, image, dim, repeats, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


# ---------------------------------------------------------------------------------------------- report
def mib(n: float) -> str:
    return f"{n / 2**20:,.2f}"


def loss_table(rows: list[dict[str, Any]], dim: int) -> list[str]:
    lines = [
        "| global N | method | step wall (s) | step CPU / rank (s) | peak extra memory / rank (MiB) "
        "| sent / rank (MiB) |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = METHODS[row["method"]]
        if row.get("skipped"):
            estimate = PML_NN_BUFFERS * row["n"] ** 2 * 4
            lines.append(
                f"| {row['n']:,} | {name} | not run: needs about {estimate / 2**30:,.1f} GiB per "
                f"rank | - | - | {mib(pml_bytes(row['n'], dim))} |"
            )
        else:
            lines.append(
                f"| {row['n']:,} | {name} | {row['time']:.3f} | {row['cpu']:.3f} | {mib(row['peak'])} | "
                f"{mib(row['bytes'])} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=[1024, 2048, 4096, 8192, 16384],
        help="global batch sizes N (split evenly over 2 processes)",
    )
    parser.add_argument(
        "--pml-max",
        type=int,
        default=2048,
        help="largest N to run the N x N methods at (PML, our generic path: memory grows as N^2 per rank)",
    )
    parser.add_argument("--dim", type=int, default=128, help="embedding width d")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed repetitions; the best is reported (the machine may be shared)",
    )
    parser.add_argument(
        "--cnn-batch", type=int, default=256, help="images per step for the chunked benchmark"
    )
    parser.add_argument("--cnn-chunk", type=int, default=64, help="chunk size for the chunked benchmark")
    parser.add_argument("--cnn-image", type=int, default=32, help="image side in pixels")
    parser.add_argument("--skip-loss", action="store_true", help="only run the chunked-step benchmark")
    parser.add_argument("--skip-cnn", action="store_true", help="only run the loss benchmark")
    parser.add_argument("--out", type=Path, default=None, help="markdown output (default: results/dated)")
    args = parser.parse_args()
    # Large buffers are mmapped and returned to the OS at free, so the resident size tracks live tensors
    # (read by the spawned children at their start).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"

    today = dt.date.today().isoformat()
    lines = [f"# Distributed layer benchmark, {today}", "", f"Machine: {machine()}.", ""]
    if not args.skip_loss:
        print(f"GlobalBatchLoss vs PML, {WORLD} gloo processes x 1 thread, d = {args.dim}")
        rows = run_loss_benchmark(sorted(args.sizes), args.pml_max, args.dim, args.repeats)
        lines += [
            f"## FastAP over the global batch: {WORLD} gloo processes, 1 thread each, d = {args.dim}, "
            f"float32, forward + backward, best of {args.repeats} (slowest rank)",
            "",
        ]
        lines += [*loss_table(rows, args.dim), ""]
    if args.skip_cnn:
        text = "\n".join(lines)
        print(text)
        out = args.out or RESULTS / f"distributed-{today}.md"
        out.write_text(text)
        print(f"written to {out}")
        return
    print(f"chunked vs direct step, small CNN, batch {args.cnn_batch}, chunk {args.cnn_chunk}, 1 thread")
    cnn = run_chunked_benchmark(args.cnn_batch, args.cnn_chunk, args.cnn_image, args.dim, args.repeats)
    lines += [
        f"## Chunked vs direct step: small CNN (3 conv + linear, dropout), {args.cnn_batch} images of "
        f"{args.cnn_image}x{args.cnn_image}, chunk {args.cnn_chunk}, FastAP, 1 process, 1 thread, best of "
        f"{args.repeats}",
        "",
        "| step | wall (s) | CPU (s) | peak extra memory (MiB) |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {r['time']:.3f} | {r['cpu']:.3f} | {mib(r['peak'])} |" for name, r in cnn.items()]
    lines += [
        "",
        f"Chunked / direct: {cnn['chunked']['time'] / cnn['direct']['time']:.2f}x wall, "
        f"{cnn['chunked']['cpu'] / cnn['direct']['cpu']:.2f}x CPU (goal: at most 1.4x).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    out = args.out or RESULTS / f"distributed-{today}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
