"""Feature-shard training benchmark: time per step of a head trained on stored vectors at huge global batches.

    python -m benchmarks.features                               # global batch 65,536, 3 steps, FastAP
    python -m benchmarks.features --batch 8192 --loss pnp --steps 5

With feature shards (``ddp-rank shards features``) the model is a head only, so the step is the loss over the
global batch: this measures that the project's reason to exist, a 65,536 global batch, trains on this machine.
The shards are synthetic (``ddp_rank.data.features.synthetic``: clustered float16 vectors, written straight to
shards; embedding 70,000 images first would take hours here and would not change the step), the run is the real
``ddp-rank train`` (stream, plan, GlobalBatchLoss, optimizer) with ``model.backbone=features``, one process. Per
step, from the run's ``metrics.jsonl``: the step time (without the wait for data) and the data wait; the table
gives the median over the steps after the first (the first pays for warm-up) and the worst step, and the CPU
seconds of the whole run beside its wall time (on a shared machine the wall time is the CPU time stretched by
the other jobs' load).

The table is printed and written to benchmarks/results/features-<YYYY-MM-DD>.md with the machine named.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import machine_description, markdown_table, write_result

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=65_536, help="global batch (default 65,536)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--loss", choices=("fastap", "pnp", "smooth_ap"), default="fastap")
    p.add_argument("--dim", type=int, default=512, help="length of the stored vectors (ResNet-18's: 512)")
    p.add_argument("--embedding-dim", type=int, default=128)
    p.add_argument("--head-hidden", type=int, default=0, help="0: linear head; else the MLP's hidden width")
    p.add_argument("--images-per-class", type=int, default=8)
    p.add_argument("--categories", type=int, default=8)
    p.add_argument("--sampler", default="random", choices=("random", "hard"))
    p.add_argument("--workers", type=int, default=1, help="data.num_workers of the run")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args()

    from ddp_rank.data.features.synthetic import write_feature_shards

    # 10% more vectors than one batch: the plan needs whole classes to spare.
    classes = -(-int(args.batch * 1.1) // args.images_per_class)
    per_category = [-(-classes // args.categories)] * args.categories
    with tempfile.TemporaryDirectory(prefix="ddp_rank-features-") as tmp:
        t0 = time.perf_counter()
        shards = write_feature_shards(
            Path(tmp) / "shards", per_category, args.images_per_class, args.dim, test_every=0
        )
        write_s = time.perf_counter() - t0
        vectors = sum(per_category) * args.images_per_class
        run = Path(tmp) / "run"
        overrides = [
            f"data.shards={shards}", "data.test_split=", f"data.global_batch_size={args.batch}",
            f"data.sampler={args.sampler}", f"data.num_workers={args.workers}", "distributed.cpu=true",
            "model.backbone=features", f"model.embedding_dim={args.embedding_dim}",
            f"model.head_hidden={args.head_hidden}", f"loss.name={args.loss}", f"train.steps={args.steps}",
            "train.eval_every=0", "train.log_every=1", "train.progress=false", "optim.lr=1e-3",
            f"train.output_dir={run}",
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "ddp_rank.cli", "train", *overrides],
            env=env,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r.get("kind") == "train"]
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_gib, cpu_s = usage.ru_maxrss / 2**20, usage.ru_utime + usage.ru_stime
    later = steps[1:] or steps
    step_times = [s["step_time"] for s in later]
    data_times = [s["data_time"] for s in later]
    header = ["loss", "global batch", "vectors (dim)", "head", "steps", "step s (median)", "step s (worst)",
              "data wait s (median)", "first step s", "loss at steps", "peak RSS GiB", "run wall s", "run CPU s"]  # fmt: skip
    table = markdown_table(
        header,
        [
            [
                args.loss,
                f"{args.batch:,}",
                f"{vectors:,} ({args.dim})",
                f"{args.dim}->{args.embedding_dim}"
                + (f" MLP {args.head_hidden}" if args.head_hidden else ""),
                str(len(steps)),
                f"{statistics.median(step_times):.2f}",
                f"{max(step_times):.2f}",
                f"{statistics.median(data_times):.2f}",
                f"{steps[0]['step_time']:.2f}",
                ", ".join(f"{s['loss']:.4f}" for s in steps),
                f"{peak_gib:.1f}",
                f"{wall:.0f}",
                f"{cpu_s:.0f}",
            ]
        ],
    )
    body = (
        f"`python -m benchmarks.features --batch {args.batch} --loss {args.loss} --steps {args.steps}` "
        f"(synthetic feature shards written in {write_s:.0f} s; sampler {args.sampler}, one process, "
        f"data.num_workers={args.workers}).\n\n{table}\n"
    )
    print(f"Machine: {machine_description()}\n\n{body}")
    if not args.no_write:
        print(write_result("features", "Training a head on feature shards: time per step", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
