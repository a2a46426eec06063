"""Training-step benchmark: images/s (direct vs chunked, 1 vs 2 processes) and the loss's share of the step.

    python benchmarks/train.py                       # CPU defaults: tiny_cnn, 32 px, global batch 128
    python benchmarks/train.py --backbone resnet18 --image-size 64 --batch 64 --steps 6

Each configuration runs as its own job (1 process: plain python; 2 processes: ``accelerate launch`` with
launch/accelerate_cpu_2proc.yaml) on synthetic shards built with the data layer, through the real ``Trainer``
(stream, model, GlobalBatchLoss, direct or chunked step, optimizer). Per step it records:

- step time and images/s (global batch / step time), after ``--warmup`` untimed steps;
- loss time: the GlobalBatchLoss forward (all-gather of embeddings and labels, the query-row loss, the
  all-reduce of the normaliser) plus its backward (the reduce-scatter), timed with identity autograd markers
  around the loss so that the backbone's backward is not counted;
- communication: the bytes the loss's collectives send per step (ring convention, ``CommCounter``) and the time
  of the same collectives replayed alone on tensors of the same shapes.

The table is printed and written to benchmarks/results/train-<YYYY-MM-DD>.md with the machine named.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description

REPO = Path(__file__).resolve().parent.parent


class _Mark:
    """Identity autograd functions that record when the backward pass reaches them."""

    @staticmethod
    def make() -> Any:
        import torch

        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, log: dict[str, float], key: str) -> torch.Tensor:  # type: ignore[override]
                ctx.log, ctx.key = log, key
                return x.view_as(x)

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
                ctx.log[ctx.key] = time.perf_counter()
                return grad, None, None

        return Mark


def worker(args: argparse.Namespace) -> None:
    """One configuration in this process (or in each of the processes accelerate started)."""
    import torch

    from ddp_rank.config import load_config
    from ddp_rank.distributed import CommCounter, GlobalBatchLoss, all_gather_ints, padded_all_gather
    from ddp_rank.distributed.collectives import all_reduce_sum, padded_reduce_scatter
    from ddp_rank.distributed.process_group import is_distributed
    from ddp_rank.train.trainer import Trainer, build_loss

    overrides = [
        f"data.shards={args.shards}",
        "data.test_split=",
        f"data.image_size={args.image_size}",
        f"data.resize_size={args.image_size}",
        f"data.global_batch_size={args.batch}",
        "data.sampler=random",
        "data.num_workers=0",
        f"model.backbone={args.backbone}",
        "model.embedding_dim=128",
        f"distributed.chunk_size={args.chunk}",
        f"train.output_dir={args.out}",
        "train.progress=false",
        f"train.steps={args.warmup + args.steps}",
    ]
    trainer = Trainer(load_config(None, overrides))
    counter = CommCounter()
    trainer.loss_fn = GlobalBatchLoss(build_loss(trainer.cfg), comm_counter=counter)
    mark = _Mark.make()
    log: dict[str, float] = {}
    base_loss = trainer.loss_fn

    def timed_loss(e: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = base_loss(mark.apply(e, log, "bwd_end"), y)
        log["fwd"] = time.perf_counter() - t0
        return mark.apply(loss, log, "bwd_start")

    trainer.loss_fn = timed_loss  # type: ignore[assignment]
    steps, losses, data = [], [], []
    try:
        for i in range(args.warmup + args.steps):
            counter.reset()
            log.clear()
            res = trainer.train_step()
            if i >= args.warmup:
                steps.append(res.step_time - res.data_time)
                data.append(res.data_time)
                losses.append(log["fwd"] + max(0.0, log.get("bwd_end", 0) - log.get("bwd_start", 0)))
        bytes_per_step = counter.total
        # The loss's collectives alone, same shapes: sizes, embeddings, labels, normaliser, reduce-scatter.
        comm = 0.0
        if is_distributed():
            n, d = trainer.local_batch, 128
            e, y = torch.randn(n, d), torch.zeros(n, dtype=torch.int64)
            reps = 5
            t0 = time.perf_counter()
            for _ in range(reps):
                sizes = all_gather_ints([n, d, 3, 1, 0])[:, 0].tolist()
                g = padded_all_gather(e, sizes)
                padded_all_gather(y, sizes)
                all_reduce_sum(torch.zeros(2))
                padded_reduce_scatter(g, sizes)
            comm = (time.perf_counter() - t0) / reps
        result = {
            "processes": trainer.world_size,
            "mode": f"chunked ({trainer.chunk_size})" if trainer.chunk_size else "direct",
            "chunks": res.chunks,
            "global_batch": args.batch,
            "step_s": statistics.median(steps),
            "data_s": statistics.median(data),
            "loss_s": statistics.median(losses),
            "comm_s": comm,
            "comm_bytes": bytes_per_step,
        }
        if trainer.is_main:
            Path(args.result).write_text(json.dumps(result))
    finally:
        trainer.close()
        trainer.accelerator.end_training()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(
    args: argparse.Namespace, processes: int, chunk: int, shards: Path, tmp: Path
) -> dict[str, Any]:
    result = tmp / f"result-{processes}-{chunk}.json"
    out = tmp / f"run-{processes}-{chunk}"
    common = [
        "--worker", "--shards", str(shards), "--out", str(out), "--result", str(result),
        "--backbone", args.backbone, "--image-size", str(args.image_size), "--batch", str(args.batch),
        "--chunk", str(chunk), "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // processes))}
    if processes == 1:
        cmd = [sys.executable, __file__, *common]
    else:
        cmd = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--config_file", str(REPO / "launch" / "accelerate_cpu_2proc.yaml"),
            "--num_processes", str(processes), "--main_process_port", str(_free_port()),
            __file__, *common,
        ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(result.read_text())


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| processes | step | global batch | images/s | step ms | loss + comm ms (share) "
        "| comm alone ms (share) | comm MB/step/rank |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = r["step_s"]
        lines.append(
            f"| {r['processes']} | {r['mode']} | {r['global_batch']} | {r['global_batch'] / step:.1f} "
            f"| {1000 * step:.1f} | {1000 * r['loss_s']:.1f} ({100 * r['loss_s'] / step:.1f}%) "
            f"| {1000 * r['comm_s']:.2f} ({100 * r['comm_s'] / step:.1f}%) | {r['comm_bytes'] / 2**20:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backbone", default="tiny_cnn")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument("--chunk", type=int, default=16, help="chunk size of the chunked runs")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--output", default=None, help="markdown file (default benchmarks/results/train-DATE.md)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shards", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    from ddp_rank.data.build import BuildOptions, build_shards
    from ddp_rank.data.listing import read_image_folder
    from ddp_rank.data.synthetic import write_image_folder

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        # 4 categories x 40 classes x 4 images: enough for every rank's share of a 128-image batch.
        write_image_folder(tmp / "images", [[4] * 40] * 4, image_size=args.image_size, seed=0)
        shards = tmp / "shards"
        build_shards(read_image_folder(tmp / "images"), shards, BuildOptions(progress=False))
        rows = []
        for processes in (1, 2):
            for chunk in (0, args.chunk):
                t0 = time.perf_counter()
                rows.append(run_config(args, processes, chunk, shards, tmp))
                print(
                    f"  {processes} process(es), chunk {chunk or '-'}: {time.perf_counter() - t0:.0f} s",
                    flush=True,
                )
    text = table(rows)
    print(text)
    date = dt.date.today().isoformat()
    out = Path(args.output) if args.output else REPO / "benchmarks" / "results" / f"train-{date}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    section = (
        f"## {args.backbone}, {args.image_size} px, global batch {args.batch}, chunk {args.chunk}\n\n"
        f"Machine: {machine_description()}.\n\n"
        f"Command: `python benchmarks/train.py --backbone {args.backbone} --image-size {args.image_size} "
        f"--batch {args.batch} --chunk {args.chunk} --steps {args.steps}`. Median over {args.steps} steps after "
        f"{args.warmup} warm-up steps.\n\n{text}\n"
    )
    header = (
        f"# Training step benchmark, {date}\n\n"
        "FastAP loss (10 bins), 128-d embeddings, synthetic shards, the real Trainer step (stream, model, "
        "GlobalBatchLoss, direct or chunked step, Adam). Data loading runs in the training process and its time is "
        "excluded from the step time. 'loss + comm' is the GlobalBatchLoss forward and backward including its "
        "collectives; 'comm alone' replays those collectives (sizes, embeddings, labels, normaliser, reduce-scatter) "
        "on tensors of the same shapes. With 2 processes each uses half the cores (OMP_NUM_THREADS). Each run "
        "of the script appends a section.\n\n"
    )
    previous = out.read_text() if out.is_file() else header
    out.write_text(previous.rstrip("\n") + "\n\n" + section)
    print(f"written: {out}")


if __name__ == "__main__":
    main()
