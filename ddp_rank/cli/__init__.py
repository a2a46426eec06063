"""The ``ddp-rank`` command: a thin dispatcher over the sub-commands of this package.

Every command-line front end lives here, at the top of the layers, one module per group of sub-commands
(``shards``, ``plan``, ``train``, ``eval``, ``deploy`` for export / index / search, ``sweep``, ``compare``). Each exposes
``register(subparsers)``, which adds its parser and sets ``func`` (a callable taking the parsed namespace and
returning an exit code); the work itself is in the library below. Config-driven commands take their
``--config`` and overrides from ``ddp_rank.cli.arguments``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# Modules that provide a ``register(subparsers)`` function, in the order they appear in ``--help``.
_COMMAND_MODULES: tuple[str, ...] = (
    "ddp_rank.cli.shards",
    "ddp_rank.cli.plan",
    "ddp_rank.cli.train",
    "ddp_rank.cli.eval",
    "ddp_rank.cli.deploy",
    "ddp_rank.cli.sweep",
    "ddp_rank.cli.compare",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-rank",
        description="Distributed deep metric learning with global-batch listwise ranking losses.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
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
