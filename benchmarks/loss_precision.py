"""What the faster similarity matmul (``matmul_precision`` = tf32 / bf16) does to the losses' value, gradient and time.

For each loss, one batch of N images in d dimensions (K per class, classes drawn around random centres) is
run forward + backward at ``highest`` (float32 matmul) and at each faster precision. Reported: the largest
change of a similarity S = x x^T over the batch, the change of the loss value, the gradient's relative change
in norm and its cosine to the float32 gradient, and the forward + backward time (best of ``--repeats``). On CPU
TF32 is float32 (no change, by design); its speed-up is measured on CUDA only.

    python -m benchmarks.loss_precision                       # N = 512, d = 128, on CPU
    python -m benchmarks.loss_precision --device cuda --n 16384 --dim 512
    python -m benchmarks.loss_precision --device cuda --n 16384 --dim 512 --json rows.json  # gpu_check reads it

The losses run with their default kernel (``kernel=auto``: the fused Triton passes on CUDA float32, torch
elsewhere); ``matmul_precision`` changes the similarity matmul only.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.common import markdown_table, write_json, write_result
from ddp_rank.losses import FastAPLoss, PNPLoss, SmoothAPLoss

MAKE = {
    "FastAP": lambda p: FastAPLoss(matmul_precision=p),
    "PNP-Dq": lambda p: PNPLoss("Dq", alpha=4.0, matmul_precision=p),
    "Smooth-AP": lambda p: SmoothAPLoss(matmul_precision=p),
}
PRECISIONS = ("highest", "tf32", "bf16")


def batch(n: int, dim: int, per_class: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n) // per_class
    centres = torch.randn(int(labels.max()) + 1, dim, generator=g)
    x = centres[labels] + torch.randn(n, dim, generator=g)
    return x.to(device), labels.to(device)


def run(
    loss: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor, repeats: int
) -> tuple[float, torch.Tensor, float]:
    """(loss value, gradient, best forward + backward seconds)."""
    best, value, grad = float("inf"), 0.0, torch.empty(0)
    for _ in range(repeats):
        e = x.clone().requires_grad_()
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = loss(e, labels)
        out.backward()
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        value, grad = float(out.detach()), e.grad
    assert grad is not None
    return value, grad, best


def similarity_change(x: torch.Tensor, precision: str) -> float:
    """Largest |S' - S| over the batch's similarities of unit rows, S' computed at ``precision``."""
    u = F.normalize(x.float(), dim=1)
    exact = u @ u.T
    if precision == "bf16":
        faster = (u.bfloat16() @ u.bfloat16().T).float()
    else:
        previous = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        try:
            faster = u @ u.T
        finally:
            torch.backends.cuda.matmul.allow_tf32 = previous
    return float((faster - exact).abs().max())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--per-class", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON, after each row")
    args = p.parse_args()
    x, labels = batch(args.n, args.dim, args.per_class, args.device)
    rows, records = [], []
    for name, make in MAKE.items():
        value, grad, seconds = run(make("highest"), x, labels, args.repeats)
        for precision in PRECISIONS[1:]:
            v, g, s = run(make(precision), x, labels, args.repeats)
            cosine = float(F.cosine_similarity(g.flatten(), grad.flatten(), dim=0))
            change = float((g - grad).norm() / grad.norm())
            ds = similarity_change(x, precision)
            rows.append(
                [
                    name,
                    precision,
                    f"{ds:.1e}",
                    f"{abs(v - value):.1e}",
                    f"{change:.1%}",
                    f"{cosine:.4f}",
                    f"{1000 * seconds:.1f} ms",
                    f"{1000 * s:.1f} ms",
                ]
            )
            records.append({"loss": name, "precision": precision, "n": args.n, "dim": args.dim,
                            "device": args.device, "similarity_change": ds,
                            "loss_change": abs(v - value), "grad_change": change, "grad_cosine": cosine,
                            "time_highest_s": seconds, "time_s": s})  # fmt: skip
            if args.json:
                write_json(args.json, records)
            print(rows[-1], flush=True)
    header = [
        "loss",
        "precision",
        "max |dS|",
        "|d loss|",
        "grad change",
        "grad cosine",
        "time highest",
        "time",
    ]
    table = markdown_table(header, rows)
    body = (
        f"Command: `python -m benchmarks.loss_precision --n {args.n} --dim {args.dim} --per-class "
        f"{args.per_class} --repeats {args.repeats} --device {args.device}`\n\n"
        f"N = {args.n}, d = {args.dim}, {args.per_class} images per class, float32 inputs, forward + backward, "
        f"best of {args.repeats}; changes are against matmul_precision=highest.\n\n" + table
    )
    print(table)
    print(
        f"written to {write_result('loss-precision', 'Losses: effect of the faster similarity matmul', body)}"
    )


if __name__ == "__main__":
    main()
