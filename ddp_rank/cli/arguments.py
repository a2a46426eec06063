"""The arguments every config-driven sub-command shares: ``--config FILE`` and ``section.key=value`` overrides.

One definition, so ``train``, ``plan``, ``eval``, ``export``, ``sweep`` and the rest take overrides the same way;
``ddp_rank.cli.parse_command`` lets them stand on both sides of the flags.
"""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser, config_help: str) -> None:
    """Add ``--config`` (with ``config_help``) and the ``overrides`` positional to ``parser``."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
