"""Time and peak memory of the exact verification figures (``ddp_rank.eval.verification``) on large test splits.

A 100,000-image split has 5e9 pairs: 20 GB as float32 scores. The verification scores them in blocks of rows and
keeps only the positive pairs' scores, so its memory is the positive pairs (about 28 bytes each) plus one block
(``--block-mb``). Peak memory is what tracemalloc sees (numpy reports every array it allocates; the embeddings
themselves are counted apart); the resident set size of the process is given too. Embeddings: random unit
vectors in classes of SOP's sizes (2-12 images), clustered so that positives score higher than negatives.

    python -m benchmarks.verification                      # N = 100,000, d = 128
    python -m benchmarks.verification --n 20000 --no-write
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc

import numpy as np

from benchmarks.common import markdown_table, write_result
from ddp_rank.eval.verification import verification_metrics


def sop_like(n: int, dim: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` unit vectors in classes of 2-12 images, each image its class centre plus noise."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 13, size=n // 2)
    labels = np.repeat(np.arange(len(sizes)), sizes)[:n]
    centres = rng.standard_normal((len(sizes), dim)).astype(np.float32)
    e = centres[labels] + 1.5 * rng.standard_normal((n, dim)).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    return e, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--block-mb", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-write", action="store_true", help="print only; no results/ file")
    args = parser.parse_args()
    e, y = sop_like(args.n, args.dim, args.seed)
    tracemalloc.start()
    wall, cpu = time.perf_counter(), time.process_time()
    metrics, _ = verification_metrics(e, y, block_bytes=args.block_mb << 20)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    pairs = args.n * (args.n - 1) // 2
    header = ["N", "d", "pairs", "positive pairs", "block", "wall", "CPU", "peak (tracemalloc)",
              "max RSS", "pairs as float32"]  # fmt: skip
    row = [
        f"{args.n:,}",
        str(args.dim),
        f"{pairs:.2e}",
        f"{metrics['num_positive_pairs']:,}",
        f"{args.block_mb} MiB",
        f"{wall:.0f} s",
        f"{cpu:.0f} s",
        f"{peak / 2**20:.0f} MiB",
        f"{rss / 2**20:.0f} MiB",
        f"{4 * pairs / 2**30:.1f} GiB",
    ]
    table = markdown_table(header, [row])
    figures = ", ".join(
        f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and not k.startswith("num_")
    )
    body = (
        f"`python -m benchmarks.verification --n {args.n} --dim {args.dim} --block-mb {args.block_mb}`\n\n{table}\n\n"
        f"Figures on these synthetic embeddings: {figures}.\n\n"
        f"Embeddings ({args.n:,} x {args.dim} float32, {e.nbytes / 2**20:.0f} MiB) not counted in the tracemalloc "
        "peak; max RSS includes them and the Python, numpy and torch libraries. Wall time on a shared machine: "
        "CPU time is the steadier figure."
    )
    print(body)
    if not args.no_write:
        print(f"\nwritten: {write_result('verification', 'Exact verification on large splits', body)}")


if __name__ == "__main__":
    main()
