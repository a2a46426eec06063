"""A sub-command as its module declares it (:class:`Command`), and the one function that makes parsers of them.

A module names each of its sub-commands once, with its help, what it takes and what runs it; the dispatcher
(``ddp_rank.cli.build_parser``) adds the parsers, so no module creates one or wires its ``func`` itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EXIT_USAGE", "Command", "add_commands"]

EXIT_USAGE = 2
"""The exit code of a command line that cannot run as given (argparse's own for a usage error)."""


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``arguments`` of a command that takes none of its own (a group: its sub-commands do)."""


@dataclass(frozen=True)
class Command:
    """One sub-command: ``help`` is its line in the parent's ``--help``, ``description`` the text its own
    ``--help`` opens with (printed as written, line breaks kept, with ``raw_description``).
    ``arguments(parser)`` declares what it takes; ``run(args)`` does the work on the parsed namespace and
    returns the exit code. A group (``ddp-rank shards``) has ``subcommands`` instead of a ``run``, and a
    command line names one of them."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    run: Callable[[argparse.Namespace], int] | None = None
    description: str | None = None
    raw_description: bool = False
    subcommands: Sequence[Command] = ()

    def __post_init__(self) -> None:
        if (self.run is None) == (not self.subcommands):
            raise ValueError(f"command {self.name!r}: a run or (a group) sub-commands, one of the two")


def add_commands(subparsers: Any, commands: Sequence[Command]) -> None:
    """Add the parser of each of ``commands``, in their order, to ``subparsers`` (what ``add_subparsers``
    returns): its arguments and its ``run`` as ``func``, or a group's sub-commands (their name in the namespace
    as ``<group>_command``)."""
    for command in commands:
        parser = subparsers.add_parser(
            command.name,
            help=command.help,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter
            if command.raw_description
            else argparse.HelpFormatter,
        )
        command.arguments(parser)
        if command.subcommands:
            nested = parser.add_subparsers(
                dest=f"{command.name}_command", metavar="SUBCOMMAND", required=True
            )
            add_commands(nested, command.subcommands)
        else:
            parser.set_defaults(func=command.run)
