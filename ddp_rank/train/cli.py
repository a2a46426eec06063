"""``ddp-rank train --config FILE [section.key=value ...]``: thin; the loop is ``ddp_rank.train.trainer``.

Examples::

    ddp-rank train --config configs/demo.yaml train.steps=20
    accelerate launch --config_file launch/accelerate_cpu_2proc.yaml -m ddp_rank.cli train \\
        --config configs/demo.yaml data.shards=data/emoji-shards
    ddp-rank train --help-config          # every key with its type, default, choices and meaning
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ddp_rank.config import ConfigError, describe, load_config

__all__ = ["register", "run"]

EXIT_USAGE = 2


def register(subparsers: Any) -> None:
    """Add the ``train`` sub-command."""
    p = subparsers.add_parser(
        "train",
        help="train an embedding network with a global-batch ranking loss (also under accelerate launch)",
        description="Train with the config FILE, overridden by section.key=value pairs "
        "(see --help-config). The merged config is saved as OUTPUT_DIR/config.yaml.",
    )
    p.add_argument("--config", help="experiment YAML (configs/*.yaml); defaults are used without it")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument("--help-config", action="store_true", help="list every config key and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load the config, train, print where the outputs are. Errors in the setup print one clear line."""
    if args.help_config:
        print(describe())
        return 0
    from ddp_rank.train.checkpoint import CheckpointError
    from ddp_rank.train.model import ModelError
    from ddp_rank.train.trainer import TrainError, run_training

    try:
        cfg = load_config(args.config, args.overrides)
        summary = run_training(cfg)
    except (ConfigError, ModelError, CheckpointError, TrainError) as exc:
        print(f"ddp-rank train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if summary.get("world_size") is not None and _is_main():
        print(f"done: {summary['steps']} steps, outputs in {cfg.train.output_dir}")
    return 0


def _is_main() -> bool:
    import os

    return int(os.environ.get("RANK", "0")) == 0
