"""A head's step on feature shards: the trainer against a bare loop, both timed from outside (issue 48, point 1).

    python -m benchmarks.head_step                                  # global batches 64, 1,024, 8,192
    python -m benchmarks.head_step --batches 1024 --steps 40 --rounds 3

The trainer is the real ``ddp-rank train`` (``model.backbone=features``, one process, the CPU): the feature
stream, the plan, GlobalBatchLoss, Adam, the warm-up + cosine schedule, its logs and checks. The bare loop is
what a user would write by hand around the same parts: the vectors in one tensor, class-balanced batches drawn
by index, the same head, loss (FastAP, 10 bins), Adam and schedule, and a finite-loss check per step.

Both run in this process (after one untimed warm-up run of each: imports, first calls) for N and for 2N steps,
each timed from outside as a whole call (the trainer's ``run_training``, from its config to its last file), and
a step costs (wall(2N) - wall(N)) / N: start-up, loading and the last checkpoint are paid alike by both runs of
a pair and cancel, and nothing a step does can move out of the timed window. The runs are interleaved (trainer N, bare N, trainer 2N, bare 2N, per round) so
a change of the machine's load touches both alike; the table gives each round's ratio and their median. The
target: trainer <= 1.3 x bare + 3 ms at global batches 64 and 1,024, <= 1.1 x bare at 8,192.

The table is printed and written to benchmarks/results/head-step-<YYYY-MM-DD>.md with the machine named and the
command that made it.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchmarks.common import machine_description, markdown_table, write_result

DEFAULT_STEPS = {64: 1000, 1024: 200, 8192: 10}
EPOCH = 100_000
"""data.steps_per_epoch of the runs: no epoch ends (and no epoch checkpoint) inside the timed steps."""


def overrides(shards: Path, batch: int, steps: int, run: Path) -> list[str]:
    """The config of both loops (the bare loop reads the same one, so head, loss and schedule agree)."""
    return [
        f"data.shards={shards}", "data.test_split=", f"data.global_batch_size={batch}", "data.sampler=random",
        f"data.steps_per_epoch={EPOCH}", "distributed.cpu=true", "model.backbone=features",
        "model.embedding_dim=128", "loss.name=fastap", "loss.num_bins=10", f"train.steps={steps}",
        "train.eval_every=0", "train.progress=false", "optim.lr=1e-3", "optim.schedule=cosine",
        f"optim.warmup_steps={max(1, steps // 10)}", f"train.output_dir={run}",
    ]  # fmt: skip


def trainer_run(shards: Path, batch: int, steps: int, run: Path) -> None:
    """The real trainer, as ``ddp-rank train`` runs it."""
    from ddp_rank.config import load_config
    from ddp_rank.train.trainer import run_training

    run_training(load_config(None, overrides(shards, batch, steps, run)))


def bare_run(shards: Path, batch: int, steps: int, run: Path, images_per_class: int) -> None:
    """The hand-written loop (see the module docstring), from the same config."""
    import torch

    from ddp_rank.config import load_config
    from ddp_rank.data.features.records import feature_dim
    from ddp_rank.data.format.manifest import Manifest
    from ddp_rank.data.reading.feature_table import load_feature_table
    from ddp_rank.data.reading.reader import ClassReader
    from ddp_rank.model import build_model
    from ddp_rank.train.optim import build_optimizer, build_scheduler
    from ddp_rank.train.setup import build_loss

    cfg = load_config(None, overrides(shards, batch, steps, run))
    manifest = Manifest.load(shards)
    dim = feature_dim(manifest) or 0
    table = load_feature_table(ClassReader(manifest, "train"), manifest, "train", dim)
    vectors = torch.from_numpy(table.vectors.astype("float32"))
    classes = torch.tensor([c for c in range(len(table.starts)) if table.starts[c] >= 0])
    starts = torch.from_numpy(table.starts)[classes]
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model, cfg.data.image_size, dim)
    loss_fn = build_loss(cfg.loss)
    optimizer = build_optimizer(model.parameter_groups(cfg.optim.lr, cfg.optim.head_lr_mult, 0.0), cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, steps)
    generator = torch.Generator().manual_seed(0)
    model.train()
    for step in range(steps):
        chosen = torch.randperm(len(classes), generator=generator)[: batch // images_per_class]
        rows = (starts[chosen, None] + torch.arange(images_per_class)).reshape(-1)
        labels = classes[chosen].repeat_interleave(images_per_class)
        loss = loss_fn(model(vectors[rows]), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if not math.isfinite(float(loss.detach())):
            raise SystemExit(f"step {step}: the loss is {float(loss.detach())}")


def timed(run: Callable[[], None]) -> tuple[float, float]:
    """(wall, CPU) seconds of ``run()``: the CPU time of this process, every thread, is what the machine's load
    stretches least."""
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - t0, time.process_time() - c0


def _columns(trainer_ms: list[float], bare_ms: list[float], batch: int) -> list[str]:
    """A measure's columns: each round's figures, the ratios, their median, the rounds within the target."""
    ratios = [t / b for t, b in zip(trainer_ms, bare_ms)]
    within = [t <= (1.1 * b if batch >= 8192 else 1.3 * b + 3) for t, b in zip(trainer_ms, bare_ms)]
    return [
        ", ".join(f"{x:.1f}" for x in trainer_ms),
        ", ".join(f"{x:.1f}" for x in bare_ms),
        ", ".join(f"{x:.2f}" for x in ratios),
        f"{statistics.median(ratios):.2f}",
        f"{sum(within)} of {len(within)}",
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", "--batch", dest="batch", type=int, nargs="+", default=[64, 1024, 8192])
    p.add_argument("--steps", type=int, default=0, help="N (0: 1,000, 200, 10 for batches 64, 1,024, 8,192)")
    p.add_argument(
        "--rounds", type=int, default=2, help="interleaved rounds (trainer N, bare N, trainer 2N, bare 2N)"
    )
    p.add_argument("--vectors", type=int, default=70_000, help="vectors in the training split")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--images-per-class", type=int, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch's intra-op threads (0: torch's default)")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)  # the trainer's start and end lines, per run

    from ddp_rank.data.features.synthetic import write_feature_shards

    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp_rank-head-step-") as tmp:
        classes = -(-args.vectors // args.images_per_class)
        shards = write_feature_shards(
            Path(tmp) / "shards", [-(-classes // 8)] * 8, args.images_per_class, args.dim, test_every=0
        )
        k = args.images_per_class
        trainer_run(
            shards, args.batch[0], 2, Path(tmp) / "warm-up-t"
        )  # imports and first-call costs, untimed
        bare_run(shards, args.batch[0], 2, Path(tmp) / "warm-up-b", k)
        for batch in args.batch:
            n = args.steps or DEFAULT_STEPS.get(batch, 20)
            per_round: dict[str, list[float]] = {name: [] for name in ("t", "b", "tc", "bc")}
            for r in range(args.rounds):
                took: dict[tuple[str, int], tuple[float, float]] = {}
                for steps in (n, 2 * n):
                    run = Path(tmp) / f"run-{batch}-{r}-{steps}"
                    took["t", steps] = timed(partial(trainer_run, shards, batch, steps, run / "t"))
                    took["b", steps] = timed(partial(bare_run, shards, batch, steps, run / "b", k))
                for name in ("t", "b"):
                    per_round[name].append(1e3 * (took[name, 2 * n][0] - took[name, n][0]) / n)
                    per_round[name + "c"].append(1e3 * (took[name, 2 * n][1] - took[name, n][1]) / n)
                print(
                    f"batch {batch} round {r}: wall trainer {per_round['t'][-1]:.1f} ms, bare "
                    f"{per_round['b'][-1]:.1f} ms; CPU trainer {per_round['tc'][-1]:.1f} ms, bare "
                    f"{per_round['bc'][-1]:.1f} ms",
                    flush=True,
                )
            rows.append([f"{batch:,}", str(n), *_columns(per_round["t"], per_round["b"], batch), *_columns(
                per_round["tc"], per_round["bc"], batch)])  # fmt: skip
    header = ["global batch", "N"] + [
        f"{kind} {column}"
        for kind in ("wall", "CPU")
        for column in ("trainer ms/step", "bare ms/step", "ratio per round", "median ratio", "within target")
    ]
    command = (
        f"python -m benchmarks.head_step --batches {' '.join(map(str, args.batch))} --steps {args.steps} "
        f"--rounds {args.rounds} --vectors {args.vectors} --dim {args.dim} --images-per-class {args.images_per_class}"
        + (f" --threads {args.threads}" if args.threads else "")
    )
    body = (
        f"`{command}`\n\nSynthetic feature shards ({args.vectors:,} vectors of {args.dim}, float16), linear head "
        f"{args.dim} -> 128, FastAP 10 bins, Adam, warm-up + cosine, one process on the CPU. Step time = "
        "(t(2N) - t(N)) / N of whole runs in one process (wall and CPU time), trainer and bare loop interleaved in "
        "each round; target: trainer <= 1.3 x bare + 3 ms below 8,192, <= 1.1 x bare at 8,192.\n\n"
        f"{markdown_table(header, rows)}\n"
    )
    print(f"Machine: {machine_description()}\n\n{body}")
    if not args.no_write:
        print(write_result("head-step", "A head's step on feature shards: trainer vs a bare loop", body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
