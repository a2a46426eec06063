"""Forward + backward time and peak memory of the listwise losses against pytorch-metric-learning.

Every measurement runs in a fresh subprocess so that peak memory (``ru_maxrss`` above the baseline taken
once the inputs exist) belongs to that loss alone. The peer is skipped where its predicted memory exceeds
``--peer-memory-gb`` (its [L, N, N] or [N, N, N] tensors) and reported as such. The floor is the time of the
three N x N x d matmuls any exact method needs (S = E E^T, G E, G^T E), done in row chunks.

    python benchmarks/loss.py                       # N = 256 .. 16384
    python benchmarks/loss.py --sizes 256,...,65536 # the full table (long on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, write_result

SAMPLES_PER_CLASS = 4
LOSSES = ("fastap", "pnp_dq", "smooth_ap")


def _ours(name: str):
    from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

    return {
        "fastap": lambda: FastAPLoss(10),
        "pnp_dq": lambda: PNPLoss("Dq", alpha=4.0),
        "smooth_ap": lambda: SmoothAPLoss(),
    }[name]()


def _peer(name: str):
    from pytorch_metric_learning import losses as pml

    return {
        "fastap": lambda: pml.FastAPLoss(num_bins=10),
        "pnp_dq": lambda: pml.PNPLoss(variant="Dq", alpha=4),
        "smooth_ap": lambda: pml.SmoothAPLoss(),
    }[name]()


def peer_bytes(name: str, n: int) -> float:
    """Rough peak of pytorch-metric-learning's implementation (float32): its dense intermediate tensors."""
    if name == "fastap":
        return 4.0 * n * n * (3 * 11 + 6)
    return 4.0 * n**3 * 5


def _inputs(n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) // SAMPLES_PER_CLASS
    x = torch.randn(n // SAMPLES_PER_CLASS + 1, dim, generator=g)[labels] + torch.randn(n, dim, generator=g)
    return x, labels


def _floor_step(x: torch.Tensor, chunk: int = 2048) -> None:
    for start in range(0, x.shape[0], chunk):
        q = x[start : start + chunk]
        s = q @ x.T
        s @ x
        s.T @ q


def worker(kind: str, name: str, n: int, dim: int, repeats: int) -> dict:
    x, labels = _inputs(n, dim)
    if kind != "floor":
        loss_fn = _ours(name) if kind == "ours" else _peer(name)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def step() -> None:
        if kind == "floor":
            _floor_step(x)
            return
        e = x.clone().requires_grad_(True)
        loss_fn(e, labels).backward()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    times = [first]
    for _ in range(repeats - 1 if first < 5 else 0):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    # The first call pays one-off allocations; report the best of the others when there are some.
    return {"time_s": min(times[1:] or times), "peak_mb": peak_mb}


def run_one(kind: str, name: str, n: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        name,
        str(n),
        "--dim",
        str(args.dim),
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.time_limit_s, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"> {args.time_limit_s:.0f} s"}
    if done.returncode != 0:
        reason = (
            "out of memory" if done.returncode in (-9, 137) else done.stderr.strip().splitlines()[-1][:80]
        )
        return {"error": reason}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _fmt_time(r: dict) -> str:
    return r["error"] if "error" in r else f"{r['time_s']:.3f}"


def _fmt_mem(r: dict) -> str:
    return "-" if "error" in r else f"{r['peak_mb']:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--losses", default=",".join(LOSSES))
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer-memory-gb", type=float, default=12.0)
    parser.add_argument("--time-limit-s", type=float, default=900.0)
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "LOSS", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.worker:
        kind, name, n = args.worker
        print(json.dumps(worker(kind, name, int(n), args.dim, args.repeats)))
        return

    header = [
        "loss",
        "N",
        "ours s",
        "ours MB",
        "PML s",
        "PML MB",
        "speed-up",
        "memory ratio",
        "floor s",
        "ours / floor",
    ]
    rows = []
    sizes = [int(s) for s in args.sizes.split(",")]
    floors = {n: run_one("floor", "fastap", n, args) for n in sizes}
    for name in args.losses.split(","):
        for n in sizes:
            ours = run_one("ours", name, n, args)
            if peer_bytes(name, n) > args.peer_memory_gb * 2**30:
                peer = {"error": f"needs ~{peer_bytes(name, n) / 2**30:.0f} GB"}
            else:
                peer = run_one("peer", name, n, args)
            floor = floors[n]
            ok = "error" not in ours and "error" not in peer
            row = [
                name,
                str(n),
                _fmt_time(ours),
                _fmt_mem(ours),
                _fmt_time(peer),
                _fmt_mem(peer),
                f"{peer['time_s'] / ours['time_s']:.1f}x" if ok else "-",
                f"{peer['peak_mb'] / max(ours['peak_mb'], 1):.1f}x" if ok else "-",
                _fmt_time(floor),
                f"{ours['time_s'] / floor['time_s']:.2f}"
                if "error" not in ours and "error" not in floor
                else "-",
            ]
            rows.append(row)
            print(" | ".join(row), flush=True)

    table = markdown_table(header, rows)
    body = (
        f"Forward + backward of one batch, d = {args.dim}, float32, {SAMPLES_PER_CLASS} images per class, "
        f"{args.threads} threads; best of {args.repeats} runs after the first; peak = resident memory above "
        "the inputs (MB, ru_maxrss), so a few MB is noise. PML = pytorch-metric-learning 2.9.0. "
        f"The peer is not run where its dense tensors need more than {args.peer_memory_gb:.0f} GB. "
        "Floor = the three N x N x d matmuls done in 2048-row chunks.\n\n" + table
    )
    print(table)
    print(
        f"written to {write_result('loss', 'Loss layer: time and peak memory against pytorch-metric-learning', body)}"
    )


if __name__ == "__main__":
    main()
