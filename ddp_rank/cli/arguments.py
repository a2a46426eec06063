"""The arguments every config-driven sub-command shares: ``--config FILE`` and ``section.key=value`` overrides.

One definition, so ``train``, ``plan``, ``eval``, ``export``, ``sweep`` and the rest take overrides the same way;
``ddp_rank.cli.parse_command`` lets them stand on both sides of the flags.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["CPU_CORES", "add_config_arguments", "add_max_image_pixels", "add_on_bad", "pixel_count"]

CPU_CORES = os.cpu_count() or 1
"""The default of the commands' ``--workers``."""


def add_config_arguments(parser: argparse.ArgumentParser, config_help: str) -> None:
    """Add ``--config`` (with ``config_help``) and the ``overrides`` positional to ``parser``."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")


def pixel_count(text: str) -> int:
    """``--max-image-pixels``: a positive whole number of pixels (``_`` separators allowed, ``100_000_000``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a positive whole number of pixels (e.g. 100000000)"
        )
    return value


def add_max_image_pixels(p: argparse.ArgumentParser, what: str) -> None:
    """``--max-image-pixels``: the pixel limit of the images a command reads (``decode``)."""
    from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS

    p.add_argument(
        "--max-image-pixels",
        type=pixel_count,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help=f"an image larger than this (width x height, from its header) {what} "
        f"(data.max_image_pixels; default {DEFAULT_MAX_IMAGE_PIXELS:,})",
    )


def add_on_bad(p: argparse.ArgumentParser, default: str, what: str) -> None:
    """``--on-bad error|skip`` (``what``: its help): stop at an input that does not read, or leave it out.

    The choices are the readers' ``OnBad`` (``ddp_rank.data.building.listing``), alike in every command; only
    the default and what counts as bad differ.
    """
    p.add_argument("--on-bad", choices=("error", "skip"), default=default, help=what)
