"""``ddp-rank plan --config FILE [overrides] --world-size W``: a dry run of the data plan, before any GPU is held.

It reads only the manifest (a directory or a URL) and answers what a user needs before launching: the epoch
length, the categories the sampler can use and those it leaves out (images a step needs vs images they have),
the per-rank batch, whether the step is chunked, the loss's work space per rank, and the time to plan a step.
It draws and deals the first steps exactly as the ranks will. When the config cannot start, it says why and
what to change, and exits 1.

Example::

    ddp-rank plan --config configs/inat_fastap_resnet50_global65536.yaml --world-size 64 data.shards=s3://b/inat
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ddp_rank.cli.arguments import add_config_arguments
from ddp_rank.config import Config, ConfigError, load_config

EXIT_CANNOT_START = 1
EXIT_USAGE = 2


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan",
        help="dry run: steps per epoch, categories used and left out, per-rank batch and memory, from the manifest",
    )
    add_config_arguments(p, "experiment YAML (configs/*.yaml)")
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 1)),
        help="number of processes (GPUs) to plan for (default: $WORLD_SIZE or 1)",
    )
    p.add_argument("--steps", type=int, default=3, help="steps to draw and deal as a check (default 3)")
    p.set_defaults(func=run)


def _mib(n: float) -> str:
    if n < 2**20:
        return f"{n / 2**10:,.0f} KiB"
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def describe_plan(cfg: Config, world_size: int, steps: int = 3) -> tuple[list[tuple[str, str]], list[str]]:
    """(facts, problems) of ``cfg`` on ``world_size`` ranks; an empty problem list means the run can start."""
    from ddp_rank.data.manifest import Manifest
    from ddp_rank.data.plan import Catalog, GlobalPlan, PlanError, deal
    from ddp_rank.runtime.data_setup import schedule_config

    data = cfg.data
    facts: list[tuple[str, str]] = [("shards", data.shards), ("split", data.train_split)]
    problems: list[str] = []
    if world_size < 1:
        return facts, [f"--world-size must be at least 1, got {world_size}"]
    if data.global_batch_size % world_size:
        problems.append(
            f"data.global_batch_size={data.global_batch_size} is not divisible by {world_size} ranks: pick a "
            f"multiple of {world_size} or another number of GPUs"
        )
    try:
        manifest = Manifest.load(data.shards)
        catalog = Catalog.from_manifest(manifest, data.train_split)
    except (OSError, ValueError, KeyError) as exc:
        return facts, [*problems, f"data.shards: {exc}"]
    images = sum(catalog.class_sizes.values())
    facts.append(("usable classes / images", f"{len(catalog.class_sizes):,} / {images:,}"))
    if catalog.singletons:
        facts.append(("single-image classes", f"{catalog.singletons:,} (left out: no positive)"))
    sampler = data.sampler + (f", K={data.images_per_class}" if data.sampler == "pk" else "")
    facts.append(("sampler", sampler))
    try:
        plan = GlobalPlan(catalog, schedule_config(cfg), data.global_batch_size)
    except PlanError as exc:
        return facts, [*problems, f"the sampler cannot be met: {exc}"]
    facts.append(("steps per epoch", f"{plan.steps_per_epoch:,}"))
    used = [catalog.category_names[c] for c in plan.schedule.categories]
    if plan.schedule.by_category or data.sampler == "hard_unlabelled":
        facts.append(
            ("categories used", f"{len(used)}: {', '.join(used[:12])}{' ...' if len(used) > 12 else ''}")
        )
    for left in plan.left_out:
        facts.append(("left out", str(left)))
    local = data.global_batch_size // world_size
    chunk = cfg.distributed.chunk_size
    chunked = bool(chunk and local > chunk)
    facts.append(("ranks / local batch", f"{world_size} / {local:,} images"))
    facts.append(("step", f"chunked, {-(-local // chunk)} chunks of {chunk}" if chunked else "direct"))
    budget = (cfg.loss.memory_budget_mb or 1024) * 2**20  # 0: the loss layer's CUDA default, 1 GiB
    dim = cfg.model.embedding_dim
    database = 2 * data.global_batch_size * dim * 4  # gathered embeddings and their gradient, fp32
    facts.append(
        (
            "loss work space per rank",
            f"{_mib(database + budget)} (database {_mib(database)} + chunk {_mib(budget)})",
        )
    )
    try:
        t0 = time.perf_counter()
        for s in range(min(steps, plan.steps_per_epoch)):
            deal(plan.step(0, s), world_size, plan.config.seed)
        per_step = (time.perf_counter() - t0) / max(1, min(steps, plan.steps_per_epoch))
        facts.append(("plan + deal per step", f"{1000 * per_step:.1f} ms"))
    except PlanError as exc:
        problems.append(str(exc))
    return facts, problems


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"ddp-rank plan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not cfg.data.shards:
        print("ddp-rank plan: error: data.shards is empty; pass data.shards=DIR_OR_URL", file=sys.stderr)
        return EXIT_USAGE
    facts, problems = describe_plan(cfg, args.world_size, args.steps)
    width = max(len(k) for k, _ in facts)
    for key, value in facts:
        print(f"{key.ljust(width)}  {value}")
    if problems:
        print("\ncannot start:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return EXIT_CANNOT_START
    print("\nok: the run can start")
    return 0
