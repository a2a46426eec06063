"""Compressed tar shards (``.tar.gz`` and kin): told by their first bytes, and decompressed for ``reshard``.

WebDataset reads a ``.tar.gz`` (``.tgz``, ``.tar.bz2``, ``.tar.xz``) shard as one stream, from its start. ddp_rank
reads a class as a byte range of its tar, and a compressed tar has no byte ranges: reading a class at the end of a
gzip shard means decompressing the whole shard before it, for every class, every epoch (a shard of n classes costs
about n / 2 times its size in decompression per epoch instead of one read of each class). So ``shards index`` and
``shards verify`` refuse compressed shards with one line that names the compression and the command that converts
them: ``shards reshard`` decompresses each shard once (sequentially, in blocks: bounded memory) into the work folder
of its destination, indexes the plain copy there and writes the project's plain tars; the decompressed copy (the
shards' uncompressed size on disk, on top of the output) is removed when the reshard ends.

The compression is told by the magic bytes, not the name: a gzip file named ``.tar`` is named as gzip, not as a
corrupt tar. gzip, bzip2 and xz (what webdataset writes) decompress with the standard library; zstd (which
webdataset reads on Python 3.14) decompresses where ``compression.zstd`` (Python 3.14) or the ``zstandard`` package
is importable, and is otherwise refused with the command that decompresses it.
"""

from __future__ import annotations

import bz2
import gzip
import importlib
import lzma
import re
import shutil
from typing import IO, Any

_MAGIC = (
    (re.compile(rb"\x1f\x8b"), "gzip"),
    # "BZh", the block size digit, then the first block's magic (pi in BCD): a tar whose first member's name
    # starts with "BZh" is not mistaken for one.
    (re.compile(rb"BZh[1-9]1AY&SY"), "bzip2"),
    (re.compile(rb"\xfd7zXZ\x00"), "xz"),
    (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd"),
)
HEAD_BYTES = 10
"""Bytes at the start of a file that tell its compression."""

SUFFIXES = {
    ".tar.gz": "gzip",
    ".tgz": "gzip",
    ".tar.bz2": "bzip2",
    ".tbz2": "bzip2",
    ".tbz": "bzip2",
    ".tar.xz": "xz",
    ".txz": "xz",
    ".tar.zst": "zstd",
    ".tzst": "zstd",
}
"""Names of compressed tars as webdataset and tar write them, and the compression each one names."""


CONVERT = "ddp-rank shards reshard SOURCE OUT"
"""The command that converts compressed shards, as the data layer words it (the CLI fills in the arguments)."""


class CompressedShardError(ValueError):
    """Shards are compressed tars, which cannot be read by byte range; the message names the compression and the
    command that converts them (``with_command`` puts in the exact one)."""

    def __init__(self, problem: str, compression: str, command: str = CONVERT) -> None:
        super().__init__(f"{problem}: convert the shards to plain tars with `{command}`")
        self.problem, self.compression = problem, compression

    def with_command(self, command: str) -> CompressedShardError:
        return CompressedShardError(self.problem, self.compression, command)


class DecompressError(ValueError):
    """A compressed shard that cannot be decompressed here (cut short, damaged, or no library for it)."""


def compression_of(head: bytes) -> str | None:
    """The compression whose magic bytes start ``head`` (the first ``HEAD_BYTES`` of a file), or None."""
    return next((name for magic, name in _MAGIC if magic.match(head)), None)


def sniff(f: IO[bytes]) -> str | None:
    """The compression of the open file ``f`` (read from its start; ``f`` is left at its start)."""
    f.seek(0)
    head = f.read(HEAD_BYTES)
    f.seek(0)
    return compression_of(head)


def compressed_suffix(name: str) -> str | None:
    """The compressed-tar suffix ``name`` ends with (``.tar.gz``, ``.tgz``, ...), or None."""
    lower = name.lower()
    return next((s for s in SUFFIXES if lower.endswith(s)), None)


def plain_name(name: str) -> str:
    """The name of the plain tar a compressed shard decompresses to: ``a/x.tar.gz`` -> ``a/x.tar``, ``x.tgz``
    -> ``x.tar``; a name without such a suffix (a gzip file named ``.tar``) is kept."""
    suffix = compressed_suffix(name)
    return name if suffix is None else name[: -len(suffix)] + ".tar"


def decompress(src: IO[bytes], dst: IO[bytes], compression: str, where: str) -> None:
    """Write the decompressed bytes of ``src`` to ``dst``, in blocks (memory does not grow with the shard).
    Raises ``DecompressError`` naming ``where`` for a compression no installed library reads, and for a stream
    that does not decompress (cut short or corrupt)."""
    reader, library_error = _reader(src, compression, where)
    # gzip.BadGzipFile is an OSError; the zstd libraries raise their own ZstdError, an Exception of its own.
    try:
        shutil.copyfileobj(reader, dst, 1 << 20)
    except (OSError, EOFError, lzma.LZMAError, ValueError, library_error) as exc:
        raise DecompressError(
            f"{where}: the {compression} stream does not decompress ({type(exc).__name__}: {exc}): the shard "
            "was cut short or damaged; re-create it from its source"
        ) from exc


class _NoLibraryError(Exception):
    """Raised by no decompressor: the library error of the compressions the standard library reads."""


def _reader(src: IO[bytes], compression: str, where: str) -> tuple[Any, type[Exception]]:
    """A readable file of the decompressed bytes of ``src``, and the error its library raises for a damaged
    stream beyond the standard ones."""
    if compression == "gzip":
        return gzip.GzipFile(fileobj=src, mode="rb"), _NoLibraryError
    if compression == "bzip2":
        return bz2.BZ2File(src, "rb"), _NoLibraryError
    if compression == "xz":
        return lzma.LZMAFile(src, "rb"), _NoLibraryError
    zstd: Any
    try:
        zstd = importlib.import_module("compression.zstd")  # Python 3.14
        return zstd.ZstdFile(src, "rb"), zstd.ZstdError
    except ImportError:
        pass
    try:
        zstd = importlib.import_module("zstandard")
        return zstd.ZstdDecompressor().stream_reader(src), zstd.ZstdError
    except ImportError:
        raise DecompressError(
            f"{where}: a {compression}-compressed tar, and neither Python 3.14's compression.zstd nor the "
            "zstandard package is installed to read it: pip install zstandard, or decompress the shards "
            "with `zstd -d` and index the .tar files"
        ) from None
