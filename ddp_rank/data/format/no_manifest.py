"""What to do about a folder or URL that holds no ``manifest.json``, and the name tests that advice needs.

Below the reading and the building of shards alike: ``Manifest.load`` puts this advice into its "not found"
error, and ``shards index`` / ``shards reshard`` (``building.shard_sources``) refuse compressed folders and tell
patterns from folders with the same tests, so the format package imports nothing of the building package.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ddp_rank.data.format.compressed import (
    HEAD_BYTES,
    SUFFIXES,
    CompressedShardError,
    compressed_suffix,
    compression_of,
)
from ddp_rank.data.format.manifest_parts import is_url, natural_key

__all__ = ["is_pattern", "names_shards", "no_manifest_advice", "refuse_compressed"]

_GLOB = "*?["
_PATTERN = "{" + _GLOB


def is_pattern(text: str) -> bool:
    """Whether ``text`` holds a brace range or glob character."""
    return any(ch in text for ch in _PATTERN)


def names_shards(source: str | os.PathLike[str]) -> bool:
    """Whether ``source`` names shards itself (a brace pattern, a glob, one tar file, compressed or not) rather
    than a folder of them (``shard_sources.split_source`` cuts such a source into folder and pattern)."""
    text = os.fspath(source)
    named = is_pattern(text) or text.lower().endswith(".tar") or compressed_suffix(text) is not None
    return named and (is_url(text) or not Path(text).is_dir())


def refuse_compressed(base: Path) -> None:
    """Refuse a directory that holds compressed shards (in it or its sub-directories): ``compressed``."""
    found = sorted(
        (
            str(p.relative_to(base))
            for depth in ("*", "*/*")
            for p in base.glob(depth)
            if compressed_suffix(p.name)
        ),
        key=natural_key,
    )
    if found:
        suffix = compressed_suffix(found[0])
        assert suffix is not None
        shown = ", ".join(found[:3]) + (f", ... ({len(found)} in all)" if len(found) > 3 else "")
        raise CompressedShardError(
            f"{base} holds {SUFFIXES[suffix]}-compressed tar shards ({shown}), which cannot be read by byte range",
            SUFFIXES[suffix],
        )


def no_manifest_advice(root: str) -> str:
    """What to do about ``root`` when it holds no ``manifest.json``: a pattern or tar names shards (index them),
    a directory of compressed tars needs converting (``reshard``), one of plain tars indexing."""
    quoted = shlex.quote(root)
    if names_shards(root):
        return (
            f"{root} names shards, not a shard directory; index them first with `ddp-rank shards index {quoted}` "
            "(it writes manifest.json beside them; --out DIR elsewhere)"
        )
    try:
        advice = _folder_advice(root, quoted)
    except OSError:  # the folder changed while it was looked at: the general advice still holds
        advice = None
    return advice or (
        f"{root} is not a shard directory: make one with `ddp-rank shards build SOURCE {quoted}`, or index tars "
        "with `ddp-rank shards index`"
    )


def _folder_advice(root: str, quoted: str) -> str | None:
    """The advice for a local folder without a manifest whose tars say more (compressed, or plain to index);
    None when they say nothing."""
    base = Path(root)
    if not is_url(root) and base.is_dir():
        convert = f"ddp-rank shards reshard {quoted} {shlex.quote(root + '-plain')}"
        try:
            refuse_compressed(base)
        except CompressedShardError as exc:
            return str(exc.with_command(convert))
        tar = next(iter(sorted(base.glob("*.tar")) + sorted(base.glob("*/*.tar"))), None)
        if tar is not None:
            with open(tar, "rb") as f:
                compression = compression_of(f.read(HEAD_BYTES))
            if compression is not None:
                problem = f"{tar} is a {compression}-compressed tar, which cannot be read by byte range"
                return str(CompressedShardError(problem, compression, convert))
            return f"{root} holds tars without a manifest; index them with `ddp-rank shards index {quoted}`"
    return None
