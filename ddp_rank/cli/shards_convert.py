"""The advice ``shards index`` gives for compressed shards: the ``shards reshard`` command that converts them
(moved out of ``shards`` to keep that module small)."""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path


def convert_command(args: argparse.Namespace) -> str:
    """The command that converts the compressed shards ``shards index`` was given (``args``: its namespace)."""
    return reshard_command(args, plain_out(args))


def reshard_command(args: argparse.Namespace, out: str) -> str:
    """The ``shards reshard`` command that converts the compressed shards ``shards index`` was given, with the
    same shards and index options, writing plain tars to ``out``."""
    words = ["ddp-rank", "shards", "reshard", args.directory, out]
    for split in args.split:
        words += ["--split", split]
    for flag, value in (
        ("--class-field", args.class_field),
        ("--class-from-key", args.class_from_key),
        ("--category-map", args.category_map),
    ):
        if value is not None:
            words += [flag, value]
    if args.category_field != "category":
        words += ["--category-field", args.category_field]
    return shlex.join(words)


def plain_out(args: argparse.Namespace) -> str:
    """Where the reshard that converts ``index``'s compressed shards writes: ``--out`` when it names another
    directory than the shards' own, else a sibling of theirs, ``<DIR>-plain``."""
    from ddp_rank.data.building.shard_index import split_source
    from ddp_rank.data.format.manifest import is_url

    root = split_source(args.directory)[0]
    if args.out and (is_url(root) or Path(args.out).resolve() != Path(root).resolve()):
        return str(args.out)
    base = os.path.abspath(root) if root in (".", "..") else root.rstrip("/")
    return f"{base}-plain"
