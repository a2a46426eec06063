"""``ddp-rank train --config FILE [section.key=value ...]``: thin; the loop is ``ddp_rank.train``.

Examples::

    ddp-rank train --config configs/demo.yaml train.steps=20
    accelerate launch --config_file launch/accelerate_cpu_2proc.yaml -m ddp_rank.cli train \\
        --config configs/demo.yaml data.shards=data/emoji-shards
    ddp-rank train --help-config          # every key with its type, default, choices and meaning
"""

from __future__ import annotations

import argparse

from ddp_rank.cli.arguments import add_config_arguments
from ddp_rank.cli.command import EXIT_USAGE, Command
from ddp_rank.config import ConfigError, describe, load_config

__all__ = ["COMMAND", "run"]


def _arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, "experiment YAML (configs/*.yaml); defaults are used without it")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")


def run(args: argparse.Namespace) -> int:
    """Load the config, train, print where the outputs are. Errors in the setup print one clear line."""
    if args.help_config:
        print(describe())
        return 0
    from ddp_rank.runtime import AGREED_ERRORS
    from ddp_rank.runtime.failure import launch_rank, report_agreed_error
    from ddp_rank.train.preemption import EXIT_REQUEUE, RunStopped
    from ddp_rank.train.trainer import run_training

    try:
        cfg = load_config(args.config, args.overrides)
        summary = run_training(cfg)
    except RunStopped:  # every rank checkpointed the same step; the trainer said where
        return EXIT_REQUEUE
    except (ConfigError, *AGREED_ERRORS) as exc:  # raised alike on every rank: printed once, by rank 0
        report_agreed_error("ddp-rank train", exc)
        return EXIT_USAGE
    if summary.get("world_size") is not None and launch_rank() == 0:
        print(f"done: {summary['steps']} steps, outputs in {cfg.train.output_dir}")
    return 0


COMMAND = Command(
    "train",
    help="train an embedding network with a global-batch ranking loss (also under accelerate launch)",
    description="Train with the config FILE, overridden by section.key=value pairs "
    "(see --help-config). The merged config is saved as OUTPUT_DIR/config.yaml.",
    arguments=_arguments,
    run=run,
)
