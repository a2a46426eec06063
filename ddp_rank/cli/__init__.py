"""The ``ddp-rank`` command: a thin dispatcher over the sub-commands of this package.

Every command-line front end lives here, at the top of the layers, one module per group of sub-commands
(``shards``, ``plan``, ``train``, ``eval``, ``deploy`` for export / index / search, ``sweep``, ``compare``). Each
declares its sub-commands as ``ddp_rank.cli.command.Command`` records (name, help, ``arguments(parser)`` and
``run(args)``, which returns an exit code); ``build_parser`` makes their parsers. The work itself is in the
library below. Config-driven commands take their ``--config`` and overrides from ``ddp_rank.cli.arguments``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ddp_rank.cli.command import Command, add_commands


def _commands() -> list[Command]:
    """Every sub-command, in the order they appear in ``--help``."""
    from ddp_rank.cli import compare, deploy, plan, shards, sweep, train
    from ddp_rank.cli import eval as evaluate

    return [
        shards.COMMAND,
        plan.COMMAND,
        train.COMMAND,
        evaluate.COMMAND,
        *deploy.COMMANDS,
        sweep.COMMAND,
        compare.COMMAND,
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-rank",
        description="Distributed deep metric learning with global-batch listwise ranking losses.",
    )
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True), _commands())
    return parser


def parse_command(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a command line; ``section.key=value`` overrides may stand on both sides of the flags.

    argparse fills a sub-command's ``overrides`` positional with the first run of them only and leaves the
    rest unrecognised (``train.steps=2 --config c.yaml train.seed=1``); those are appended here, while an
    unknown flag is still an error.
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and not any(a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_command(argv)
    return int(args.func(args) or 0)
