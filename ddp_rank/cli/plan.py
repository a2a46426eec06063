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

from ddp_rank.cli.arguments import add_config_arguments
from ddp_rank.cli.command import EXIT_USAGE, Command
from ddp_rank.config import ConfigError, load_config

EXIT_CANNOT_START = 1


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, "experiment YAML (configs/*.yaml)")
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", 1)),
        help="number of processes (GPUs) to plan for (default: $WORLD_SIZE or 1)",
    )
    p.add_argument("--steps", type=int, default=3, help="steps to draw and deal as a check (default 3)")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        help="where the run will compute, for its work space (default: a GPU if this machine has one)",
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"ddp-rank plan: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not cfg.data.shards:
        print("ddp-rank plan: error: data.shards is empty; pass data.shards=DIR_OR_URL", file=sys.stderr)
        return EXIT_USAGE
    from ddp_rank.train.chunking.plan_report import describe_plan

    facts, problems = describe_plan(cfg, args.world_size, args.steps, args.device)
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


COMMAND = Command(
    "plan",
    help="dry run: steps per epoch, categories used and left out, per-rank batch and memory, from the manifest",
    arguments=_arguments,
    run=run,
)
