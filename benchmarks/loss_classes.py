"""Cost of the rank losses when the classes of a batch are not all the same size.

Real batches are whole classes: SOP's hold 2-12 images, iNaturalist's a long tail, and a global batch of
65,536 almost always holds one big class. The rank losses (PNP, Smooth-AP) pay ``c x P x N`` per chunk of
``c`` queries with ``P`` the widest class in the chunk, so chunks are formed from queries sorted by class size.
For each class-size distribution at the same N, this compares the time with that of UNIFORM classes holding the
same total number of (query, positive) pairs, sum_c n_c (n_c - 1), the work any exact method does
(target: within 1.5x). Forward + backward, fp32, one process.

    python -m benchmarks.loss_classes                   # N = 4096
    python -m benchmarks.loss_classes --n 16384 --repeats 3
    python -m benchmarks.loss_classes --threads 1 --losses PNP-Dq --kinds onebig256 --rounds 3
                                                        # one case, one thread, three rounds on a shared machine

With ``--rounds R`` each case and its twin are timed R times in turn (skewed, twin, skewed, twin, ...), so both
meet the same load on a shared machine; the table gives the median of the R paired ratios. The ``ddp_rank``
imported is the one of the folder it runs from (``python -m`` puts that folder first on ``sys.path``); to time
another version, run it from a folder that holds that checkout's ``ddp_rank`` beside this checkout's
``benchmarks`` (two symbolic links; ``benchmarks.common.mixed_checkout`` makes them)::

    python -c "from benchmarks.common import mixed_checkout; mixed_checkout('/path/to/other', '/tmp/mix')"
    cd /tmp/mix && python -m benchmarks.loss_classes --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from benchmarks.common import markdown_table, write_result
from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

KINDS = ("sop", "longtail", "onebig64", "onebig256")


def class_sizes(kind: str, n: int, rng: np.random.Generator) -> list[int]:
    """Class sizes adding up to n: 'sop' (2-12), 'longtail' (log-normal, 2-500), 'onebig64' / 'onebig256' (every
    class 4 but one)."""
    if kind.startswith("onebig"):
        big = int(kind.removeprefix("onebig"))
        return [big] + [4] * ((n - big) // 4)
    sizes: list[int] = []
    while sum(sizes) < n:
        if kind == "sop":
            sizes.append(int(rng.integers(2, 13)))
        else:
            sizes.append(int(np.clip(rng.lognormal(2.0, 1.0), 2, 500)))
    sizes[-1] -= sum(sizes) - n
    if sizes[-1] < 2:
        sizes[-2] += sizes.pop()
    return sizes


def uniform_like(sizes: list[int], n: int) -> list[int]:
    """Uniform classes of size k with about the same positive pairs: n (k - 1) = sum n_c (n_c - 1)."""
    pairs = sum(s * (s - 1) for s in sizes)
    k = max(2, round(1 + pairs / n))
    return [k] * (n // k) + ([n % k] if n % k >= 2 else [])


def timed(loss_fn: torch.nn.Module, sizes: list[int], dim: int, repeats: int) -> float:
    labels = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    labels = labels[torch.randperm(labels.numel(), generator=torch.Generator().manual_seed(0))]
    x = torch.randn(labels.numel(), dim, generator=torch.Generator().manual_seed(1)).requires_grad_()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        loss_fn(x, labels).backward()
        best = min(best, time.perf_counter() - start)
        x.grad = None
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--rounds", type=int, default=1, help="paired timings of each case and its twin (median ratio)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--losses", default="PNP-Dq,Smooth-AP,FastAP")
    p.add_argument("--kinds", default=",".join(KINDS))
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    every = {"PNP-Dq": PNPLoss("Dq", alpha=4.0), "Smooth-AP": SmoothAPLoss(), "FastAP": FastAPLoss(10)}
    losses = {name: every[name] for name in args.losses.split(",")}
    rows = []
    for kind in KINDS:
        sizes = class_sizes(kind, args.n, rng)  # every kind drawn, in order, so each gets the same sizes
        if kind not in args.kinds.split(","):
            continue
        twin = uniform_like(sizes, args.n)
        for name, loss_fn in losses.items():
            pairs = [
                (timed(loss_fn, sizes, args.dim, args.repeats), timed(loss_fn, twin, args.dim, args.repeats))
                for _ in range(args.rounds)
            ]
            ratios = sorted(a / b for a, b in pairs)
            t, t_uniform = min(a for a, _ in pairs), min(b for _, b in pairs)
            rows.append(
                [
                    name,
                    kind,
                    f"{len(sizes)} classes, largest {max(sizes)}",
                    f"{twin[0]} per class",
                    f"{t:.3f} s",
                    f"{t_uniform:.3f} s",
                    f"{ratios[len(ratios) // 2]:.2f}x"
                    + (f" ({ratios[0]:.2f}-{ratios[-1]:.2f})" if args.rounds > 1 else ""),
                ]
            )
            print(rows[-1], flush=True)
    header = ["loss", "classes", "batch", "uniform twin", "time", "uniform time", "ratio (goal <= 1.5)"]
    threads = torch.get_num_threads()
    table = markdown_table(header, rows)
    body = (
        f"Command: `python -m benchmarks.loss_classes {' '.join(sys.argv[1:])}`\n\n"
        f"N = {args.n}, d = {args.dim}, fp32, forward + backward, {threads} thread(s), best of {args.repeats}; the "
        f"ratio is the median of {args.rounds} paired timings (their range in brackets); the uniform twin has the "
        "same N and about the same number of (query, positive) pairs.\n\n" + table
    )
    print(table)
    print(f"written to {write_result('loss-classes', 'Rank losses: cost with uneven class sizes', body)}")


if __name__ == "__main__":
    main()
