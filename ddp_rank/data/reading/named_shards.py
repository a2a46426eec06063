"""Shards named by a URL or a path pattern, read whole and in stored order through the checked read path.

``ddp-rank export --shards-url`` and the pictures of ``ddp-rank search --grid`` read WebDataset shards that a
pattern names (``https://host/d/test-{0000..0009}.tar``, ``DIR/q-000000.tar``, ``file:///DIR/q-000000.tar``;
brace ranges expand as webdataset expands them, ``::`` joins patterns). What webdataset alone would make of a
pattern is refused in one line naming it (:func:`expand_shards`): a ``pipe:`` command, an environment variable
(``${WDS_ROOT}``), a scheme fsspec does not know. They read every sample of a shard, so a shard is read whole:
the same storage as training's reads (``storage.ShardStore``: fsspec, the retries of a transient failure, the
node-local cache) and the same tar walk as ``shards verify`` (``tar_scan``), never a reader that trusts the tar.

The manifest is looked for in the shards' folder and the folder above it (ddp_rank's own layout keeps a split's
shards in a sub-folder of the manifest's), read with the retries of a shard: only a file that is not there (a
404) means "no manifest", so a server busy for a moment (a 5xx) cannot make checked shards look unchecked, and
one that stays unreachable is an error naming the manifest. A ``manifest.json`` that is not a ddp_rank shard
manifest (another tool's, not JSON, the page a server answers any path with) is no manifest (said in one log
line); a ddp_rank manifest that fails its checks is refused. Where one lists the named shards, each is checked as training checks
its shards: its size and sha256 against the manifest's, so a shard replaced or damaged since is refused naming
it; a URL's shard is fetched once per node into ``cache_dir`` when one is given (content-addressed by that
sha256, checked before it is kept). A manifest that lists some of the named shards and not others is refused:
the others could not be checked. Shards without a manifest (other tools' shards) have nothing to be checked
against: they are read as they are, with the same retries and tar walk.

A URL's shard not in the cache is downloaded to a scratch file (removed once it is read), and a compressed tar
is decompressed to one (a stream has no byte ranges to walk; the compressed download is removed as soon as its
tar is written): the scratch disk holds one shard at a time, twice over only while one is decompressed. The
scratch folder is the system's temporary one (``$TMPDIR``), not ``cache_dir``: the cache's cap and eviction
count only the shards it keeps, a shard lands in scratch precisely when the cache declined it (too large, the
disk full), and shards without a manifest are never cached. Any failure
(no such shard, a network error that outlasts the retries, a size or sha256 that differs, a corrupt header, a
file cut short, a compressed stream that does not decompress) is one ``ShardReadError`` line naming the shard,
the fault and what to do. Samples are the members that share a key, grouped as WebDataset groups them
(consecutive members); only image, ``.cls`` and ``.json`` bytes are read, and nothing is decoded here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from braceexpand import braceexpand

from ddp_rank.data.format.compressed import DecompressError, decompress, sniff
from ddp_rank.data.format.manifest import (
    FORMAT_NAME,
    IMAGE_EXTENSIONS,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    ShardInfo,
    is_url,
    join_location,
)
from ddp_rank.data.format.manifest_parts import sha256_stream
from ddp_rank.data.format.tar_scan import Member, sample_key, tar_members
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.data.reading.storage import RETRY_S, ShardStore, retrying, url_filesystem

log = logging.getLogger(__name__)

__all__ = ["NamedShards", "ShardReadError", "ShardSample", "expand_shards"]

_KEPT = (*IMAGE_EXTENSIONS, "cls", "json")
"""The members whose bytes a sample carries."""
_REBUILD = (
    "rebuild the manifest (`ddp-rank shards build`, or `ddp-rank shards index` for other tools' shards)"
)


class ShardReadError(ValueError):
    """A named shard that cannot be read as it is; the one-line message names it, the fault and the fix."""


@dataclass(frozen=True)
class ShardSample:
    """One sample of a shard: its key (WebDataset's ``__key__``) and the bytes of its image, ``.cls`` and
    ``.json`` members by lower-case extension (whichever it has)."""

    key: str
    members: dict[str, bytes]


def expand_shards(source: str) -> list[str]:
    """The shards ``source`` names, in order: each ``::``-separated pattern brace-expanded (``file://`` names
    the local path). ``ShardReadError`` for a pattern that names no shard this reader can read
    (:func:`_unreadable`)."""
    urls: list[str] = []
    for pattern in source.split("::"):
        if not pattern:
            continue
        problem = _unreadable(pattern)
        if problem is not None:
            raise ShardReadError(f"'{pattern}': {problem}")
        urls += [_local_path(url) for url in braceexpand(pattern)]
    if not urls:
        raise ShardReadError(
            f"'{source}' names no shard; write e.g. https://host/data/shard-{{000000..000009}}.tar"
        )
    return urls


_VARIABLE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?")


def _unreadable(pattern: str) -> str | None:
    """Why ``pattern`` names shards that this reader cannot read, and the fix; None when it can. webdataset would
    run a ``pipe:`` command and expand variables; here either would only end in "no such shard" further on."""
    if pattern.startswith("pipe:"):
        return (
            "a pipe: command is not run here (shards are read by ddp_rank itself, checked against their "
            "manifest); name the shards by their URL or path instead, e.g. https://host/d/shard-{000000..000009}.tar"
        )
    variable = _VARIABLE.search(pattern)
    if variable is not None:
        return (
            f"the environment variable {variable.group()} is not expanded here; write its value in its place "
            "(or leave the pattern unquoted so that the shell expands it)"
        )
    scheme, sep, _ = pattern.partition("://")
    if sep and scheme != "file":
        import fsspec  # only for a URL

        if scheme not in fsspec.available_protocols():
            return (
                f"{scheme}:// is not a storage fsspec knows; name the shards by a path, a file://, http(s)://, "
                "s3:// or gs:// URL (s3 needs s3fs, gs gcsfs)"
            )
    return None


def _local_path(url: str) -> str:
    """``url`` with a ``file://`` scheme taken off (the path it names); any other name as it is."""
    return url[len("file://") :] if url.startswith("file://") else url


class NamedShards:
    """The shards ``source`` names (``urls``), each read whole by ``samples(url)``; see the module docstring."""

    def __init__(
        self,
        source: str,
        cache_dir: str | os.PathLike[str] | ShardCache | None = None,
        retry_s: float = RETRY_S,
    ) -> None:
        self.source = source
        self.urls = expand_shards(source)
        self.retry_s = retry_s
        manifest, self.listed = _listing(self.urls, retry_s)
        """Shard -> its manifest entry, for shards a manifest lists (empty: none does)."""
        self.store = None if manifest is None else ShardStore(manifest, cache_dir=cache_dir, retry_s=retry_s)
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    def samples(self, url: str) -> Iterator[ShardSample]:
        """The samples of the shard ``url`` in stored order; ``ShardReadError`` before the first one when the
        shard cannot be read whole or fails its checks."""
        with ExitStack() as stack:
            f = self._open(url, stack)
            members, problem = tar_members(f)
            if problem is not None:
                raise ShardReadError(
                    f"shard {url}: {problem}: the shard is damaged; replace it with a sound copy, or leave it "
                    "out of the pattern"
                )
            yield from _grouped(f, members)

    def close(self) -> None:
        """Close the files the store holds open and remove the scratch folder."""
        if self.store is not None:
            self.store.close()
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None

    # ------------------------------------------------------------------ internals

    def _open(self, url: str, stack: ExitStack) -> BinaryIO:
        """The whole shard open as a plain tar on this machine, checked against the manifest where one lists it."""
        shard = self.listed.get(url)
        downloaded: str | None = None  # a scratch copy of the shard
        try:
            if shard is not None:
                assert self.store is not None
                f = self.store.open_whole(shard)  # the store closes it
                cached = f is not None and self.store.cache is not None
                if f is None:
                    downloaded = self._scratch_file(stack, "download.tar")
                    self.store.download(shard, downloaded)
                    f = _opened(stack, downloaded)
                if not cached:  # a cached copy was checked when it was fetched
                    self._check(url, shard, f)
            elif is_url(url):
                downloaded = self._scratch_file(stack, "download.tar")
                path = downloaded
                retrying(lambda: url_filesystem(url).get_file(url, path), url, self.retry_s)
                f = _opened(stack, downloaded)
            else:
                f = _opened(stack, url)
            compression = sniff(f)
            if compression is not None:
                path = self._scratch_file(stack, "plain.tar")
                with open(path, "wb") as plain:
                    decompress(f, plain, compression, f"shard {url}")
                if downloaded is not None:  # its tar is written: one copy of the shard on the disk again
                    f.close()
                    os.unlink(downloaded)
                f = _opened(stack, path)
        except (ShardReadError, DecompressError) as exc:
            raise ShardReadError(str(exc)) from exc
        except FileNotFoundError as exc:
            raise ShardReadError(
                f"shard {url}: no such shard; fix the pattern (or the range) to name only the shards there"
            ) from exc
        except EOFError as exc:  # open_sized: not the size the manifest records
            raise ShardReadError(f"shard {url}: {exc}: restore the shard, or {_REBUILD}") from exc
        # What else the storage raised (an HTTP status, the network), past the retries.
        except Exception as exc:
            raise ShardReadError(
                f"shard {url} cannot be read ({type(exc).__name__}: {exc}); check that it is there and reachable"
            ) from exc
        return f

    def _check(self, url: str, shard: ShardInfo, f: BinaryIO) -> None:
        """Refuse a shard whose size or sha256 is not the manifest's."""
        size = os.fstat(f.fileno()).st_size
        if size != shard.bytes:
            raise ShardReadError(
                f"shard {url} is {size:,} bytes, the manifest says {shard.bytes:,} (a truncated or replaced "
                f"shard?): restore the shard, or {_REBUILD}"
            )
        if sha256_stream(f) != shard.sha256:
            raise ShardReadError(
                f"shard {url}: its sha256 differs from the manifest's (replaced or damaged since the manifest was "
                f"written): restore the shard, or {_REBUILD}"
            )

    def _scratch_file(self, stack: ExitStack, name: str) -> str:
        """A path in the scratch folder, removed when ``stack`` closes (one shard at a time on the disk)."""
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="ddp_rank-shard-")
        path = Path(self._scratch.name) / name
        stack.callback(path.unlink, missing_ok=True)
        return str(path)


def _opened(stack: ExitStack, path: str) -> BinaryIO:
    """``path`` opened for reading until ``stack`` closes."""
    return stack.enter_context(open(path, "rb"))


def _grouped(f: BinaryIO, members: list[Member]) -> Iterator[ShardSample]:
    """The samples of ``members`` (consecutive members sharing a key), with the bytes of their kept members."""
    key: str | None = None
    parts: dict[str, bytes] = {}
    for member in members:
        name, ext = sample_key(member.name)
        if name != key:
            if key is not None:
                yield ShardSample(key, parts)
            key, parts = name, {}
        if ext in _KEPT:
            if member.data is not None:
                parts[ext] = member.data
            else:
                f.seek(member.offset_data)
                parts[ext] = f.read(member.size)
    if key is not None:
        yield ShardSample(key, parts)


def _folder(location: str) -> str | None:
    """The folder of a path or URL (a local one made absolute); None above a URL's host."""
    if is_url(location):
        if "/" not in location.partition("://")[2]:
            return None
        return location.rsplit("/", 1)[0]
    return os.path.dirname(os.path.abspath(location))


def _same(location: str) -> str:
    """``location`` in the form two names of one shard compare equal in (local paths absolute, normalised)."""
    return location if is_url(location) else os.path.normpath(os.path.abspath(location))


def _manifest_in(root: str, retry_s: float) -> Manifest | None:
    """The ddp_rank manifest in the folder ``root``, None where there is none: no ``manifest.json`` (a 404, no
    such file), or one that is not a ddp_rank shard manifest (logged). A URL's is fetched whole with the
    retries of a shard (``cat_file``: fsspec's ``open`` asks ``info`` first, which reports a 5xx or a 403 as
    a missing file). Refused (``ShardReadError``): a file that cannot be read, and a ddp_rank manifest that
    fails its checks."""
    path = join_location(root, MANIFEST_NAME)
    try:
        if is_url(path):
            raw = retrying(lambda: url_filesystem(path).cat_file(path), path, retry_s)
        else:
            raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except (
        Exception
    ) as exc:  # the storage's own errors (an HTTP status other than 404, the network), local I/O
        raise ShardReadError(
            f"{path} cannot be read ({type(exc).__name__}: {exc}); check that it is there and reachable "
            "(the shards it lists are checked against it)"
        ) from exc
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8 text, nested past the interpreter's stack
        data = None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        log.info(f'{path} is not a ddp_rank shard manifest (no "format": "{FORMAT_NAME}"); not used')
        return None
    try:
        return Manifest.from_json(data, root=root)
    except ManifestError as exc:
        raise ShardReadError(str(exc)) from exc


def _listing(urls: list[str], retry_s: float = RETRY_S) -> tuple[Manifest | None, dict[str, ShardInfo]]:
    """The manifest in the shards' folder or the one above that lists them, and shard -> its entry there; (None,
    {}) when no manifest lists any. Refused (``ShardReadError``): a manifest that does not read
    (:func:`_manifest_in`), and one that lists some of the shards but not all."""
    folder = _folder(urls[0])
    parent = None if folder is None else _folder(folder)
    for root in dict.fromkeys(r for r in (folder, parent) if r is not None):
        manifest = _manifest_in(root, retry_s)
        if manifest is None:
            continue
        entries = {
            _same(manifest.shard_url(s)): s for split in manifest.splits.values() for s in split.shards
        }
        listed = {url: entries[_same(url)] for url in urls if _same(url) in entries}
        if not listed:
            continue
        missing = next((url for url in urls if url not in listed), None)
        if missing is not None:
            raise ShardReadError(
                f"shard {missing} is not listed in {join_location(root, MANIFEST_NAME)}, which lists "
                f"{len(listed)} of the {len(urls)} shard(s) named, so it cannot be checked: name only the listed "
                f"shards, or {_REBUILD}"
            )
        log.info(f"checking the {len(urls)} shard(s) against {join_location(root, MANIFEST_NAME)}")
        return manifest, listed
    return None, {}
