"""Ranged reads of shard bytes from a local directory or any URL fsspec reaches, with an optional node-local cache.

A class is one or more byte ranges of tars (``ClassSpan``), so training reads are ``read(shard, offset, length)``:
a ``seek`` + ``read`` on a local file, an HTTP ``Range`` request (or the S3 / GCS equivalent) through fsspec
for a URL. ``read_many`` reads the spans of a class: those read by range from a URL concurrently (up to
``MAX_CONCURRENT`` requests in flight, each retried on its own), the others one after the other. A reader of
every sample of a shard (``named_shards``: ``export --shards-url``) takes it whole instead: ``open_whole`` (the
local file, or the cached copy) or ``download``. We write no network client: fsspec's file systems
(``http``/``https`` need aiohttp, ``s3`` s3fs, ``gs`` gcsfs) do the transfer.

The node-local cache (``cache_dir``) keeps whole shards fetched from a URL, since every class of a shard is read
again each epoch. It is ours rather than fsspec's ``simplecache`` because that one writes the download in place
(another process on the node can read a half-written file as cached) and checks nothing; here a shard is
downloaded once per node under a file lock, to a temporary name, checked against the manifest's sha256 and only
then renamed into place, content-addressed by that sha256 (a rebuilt shard never reads a stale copy). A shard
whose download does not match is not cached; its classes are then read by range and checked one by one.
The cache is bounded (``shard_cache.ShardCache``: least recently used shards go first, never one a reader holds
open); a shard that does not fit (larger than the cap, the cap held by open shards, the disk full) is read from
the source (by range in training, whole by ``named_shards``), counted as a ``cache_fallbacks`` event. A
``cache_dir`` that cannot be used on this machine at all (it cannot be made or written: a run's recorded
directory on another machine, say) is said once when the store is made, and the store reads without a cache,
rather than failing every shard on it.

A remote read that fails on the way is retried with growing pauses for up to ``retry_s`` seconds, each retry
counted as a ``read_retries`` event, so a server restarting or a network blip costs time, not data. On the way
means (:func:`transient`): connection refused or reset, a timeout (an ``OSError`` other than a missing file, a
refused permission or a full disk), and the HTTP client's own errors, which are not ``OSError``: a connection
dropped in the middle of a body or closed by the server, and an answer 408, 429 or 5xx. Other 4xx are lasting.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from ddp_rank.data.format.manifest import Manifest, ShardInfo, is_url, sha256_file
from ddp_rank.data.reading.shard_cache import CachedShard, ShardCache, Uncached

log = logging.getLogger(__name__)

RETRY_S = 20.0
"""Default time a failing remote read is retried for (longer than a file server's restart)."""
RECACHE_S = 60.0
"""A shard that did not fit in the cache for a passing reason is tried again after this long."""

_T = TypeVar("_T")

MAX_CONCURRENT = 8
"""Most range requests of one ``read_many`` in flight at once (a class cut into many spans of a URL)."""

_RETRIED_HTTP_STATUS = (408, 429)
"""The client errors (4xx) worth another try: the request timed out, too many requests."""


def transient(exc: BaseException) -> bool:
    """Whether a remote read that raised ``exc`` may succeed when tried again (see the module docstring)."""
    if isinstance(exc, OSError):
        lasting = isinstance(exc, FileNotFoundError | PermissionError)
        return not lasting and exc.errno not in (errno.ENOSPC, errno.EDQUOT)
    try:
        # fsspec's http file system raises aiohttp's errors as they are; aiohttp is there only with fsspec[http].
        import aiohttp
    except ImportError:
        return False
    if isinstance(exc, aiohttp.ClientResponseError):
        return exc.status >= 500 or exc.status in _RETRIED_HTTP_STATUS
    return isinstance(exc, aiohttp.ClientPayloadError | aiohttp.ClientConnectionError)


def retrying(
    call: Callable[[], _T], url: str, retry_s: float = RETRY_S, on_retry: Callable[[], None] | None = None
) -> _T:
    """``call()`` (a read of ``url``), retried with growing pauses on a transient failure (:func:`transient`) for
    up to ``retry_s`` seconds, calling ``on_retry`` before each retry; a lasting failure, or the last one, raises."""
    deadline = time.monotonic() + retry_s
    pause = 0.25
    while True:
        try:
            return call()
        except Exception as exc:
            if not transient(exc) or time.monotonic() + pause > deadline:
                raise
            if on_retry is not None:
                on_retry()
            log.warning(f"{url}: {type(exc).__name__}: {exc}; retrying in {pause:.2f} s")
        time.sleep(pause)
        pause = min(2 * pause, 4.0)


def url_filesystem(url: str) -> Any:
    """fsspec's file system for ``url`` (``http``/``https`` need aiohttp, ``s3`` s3fs, ``gs`` gcsfs). A file
    system's event loop does not survive fork: each process makes its own."""
    import fsspec

    return fsspec.core.url_to_fs(url)[0]


def open_sized(path: str, size: int) -> BinaryIO:
    """``path`` opened for reading, refused (``EOFError``) unless it holds the ``size`` bytes the manifest
    records: a truncated or replaced shard costs its classes, and no span read (at most its shard's recorded
    size, see ``manifest_check``) can ask for more bytes than the file has."""
    f = open(path, "rb")  # noqa: SIM115 (kept open by the store; closed here when refused)
    actual = os.fstat(f.fileno()).st_size
    if actual != size:
        f.close()
        raise EOFError(
            f"{path} is {actual:,} bytes, the manifest says {size:,} (a truncated or replaced shard?)"
        )
    return f


class ShardStore:
    """Reads byte ranges of a manifest's shards. Picklable: DataLoader workers open their own files."""

    def __init__(
        self,
        manifest: Manifest,
        cache_dir: str | os.PathLike[str] | ShardCache | None = None,
        max_open: int = 16,
        retry_s: float = RETRY_S,
    ):
        self.manifest = manifest
        self.remote = is_url(manifest.location)
        self.cache: ShardCache | None = None
        if cache_dir and self.remote:
            self.cache = _usable_cache(cache_dir, manifest.location)
        self.max_open = max_open
        self.retry_s = retry_s
        self.counts = {"cache_fallbacks": 0, "read_retries": 0}
        """Data events since the last ``take_counts``."""
        self._files: dict[str, BinaryIO | CachedShard] = {}
        self._pid = os.getpid()
        self._fs: Any = None
        self._fs_pid = os.getpid()
        self._uncached: dict[str, float] = {}  # sha256 -> when to try caching it again (inf: never)
        self._count_lock = threading.Lock()  # retries are counted from read_many's threads

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"], state["_fs"], state["_count_lock"] = {}, None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._count_lock = threading.Lock()

    def read(self, shard: ShardInfo, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``shard``; raises OSError (FileNotFoundError for a missing shard,
        EOFError for a short read) or whatever the storage raises."""
        f = self._open_shard(shard)
        if f is None:
            url = self.manifest.shard_url(shard)
            data = self._retrying(
                lambda: self._filesystem().cat_file(url, start=offset, end=offset + length), url
            )
        else:
            data = self._read_open(f, offset, length)
        return self._checked(shard, offset, length, data)

    @staticmethod
    def _read_open(f: BinaryIO, offset: int, length: int) -> bytes:
        f.seek(offset)
        return f.read(length)

    def _read_range(self, shard: ShardInfo, url: str, offset: int, length: int) -> bytes | Exception:
        """A range of a URL (retried as ``read``), or the exception it ended with."""
        try:
            data = self._retrying(
                lambda: self._filesystem().cat_file(url, start=offset, end=offset + length), url
            )
            return self._checked(shard, offset, length, data)
        except Exception as exc:
            return exc

    @staticmethod
    def _checked(shard: ShardInfo, offset: int, length: int, data: bytes) -> bytes:
        if len(data) != length:
            raise EOFError(
                f"{shard.path}: {len(data)} of {length} bytes at offset {offset} (truncated shard?)"
            )
        return bytes(data)

    def read_many(self, requests: Sequence[tuple[ShardInfo, int, int]]) -> list[bytes | Exception]:
        """``read(shard, offset, length)`` of each request, in order; a request that fails gives the exception in
        its place (the others are still read). Ranges of a URL's uncached shards are requested concurrently;
        local files and cached shards are read in this thread (their open files are not shared across
        threads)."""
        results: list[bytes | Exception] = [b""] * len(requests)
        remote: list[tuple[int, str, int, int]] = []
        for i, (shard, offset, length) in enumerate(requests):
            try:
                f = self._open_shard(shard)
                if f is None:
                    remote.append((i, self.manifest.shard_url(shard), offset, length))
                else:
                    results[i] = self._checked(shard, offset, length, self._read_open(f, offset, length))
            except Exception as exc:
                results[i] = exc
        if len(remote) == 1:
            i, url, offset, length = remote[0]
            results[i] = self._read_range(requests[i][0], url, offset, length)
        elif remote:
            self._filesystem()  # made once here, not raced for by the threads
            with ThreadPoolExecutor(max_workers=min(MAX_CONCURRENT, len(remote))) as pool:
                futures = [
                    (i, pool.submit(self._read_range, requests[i][0], url, offset, length))
                    for i, url, offset, length in remote
                ]
                for i, future in futures:
                    results[i] = future.result()
        return results

    def open_file(self, shard: ShardInfo, block_size: int = 1 << 22) -> BinaryIO:
        """The shard as a seekable file, for reading a range too large to hold at once: the local file, or
        fsspec's buffered file of the URL (reads ``block_size`` bytes per request). The caller closes it."""
        if not self.remote:
            return open(self.manifest.shard_url(shard), "rb")
        url = self.manifest.shard_url(shard)
        return self._retrying(lambda: self._filesystem().open(url, "rb", block_size=block_size), url)

    def open_whole(self, shard: ShardInfo) -> BinaryIO | None:
        """The whole shard open on this machine: the directory's own file (refused, ``EOFError``, unless its size
        is the manifest's) or, with a cache, the cached copy (checked against the sha256 when it was fetched);
        None: fetch it with ``download``. The store keeps it open until ``close``."""
        return self._open_shard(shard)

    def download(self, shard: ShardInfo, path: str | os.PathLike[str]) -> None:
        """Copy the whole shard from its URL to the local ``path``, retried as ``read``; the caller checks it."""
        url = self.manifest.shard_url(shard)
        self._retrying(lambda: self._filesystem().get_file(url, os.fspath(path)), url)

    def take_counts(self) -> dict[str, int]:
        """The data events since the last call (and start counting again)."""
        counts, self.counts = self.counts, dict.fromkeys(self.counts, 0)
        return counts

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    # ------------------------------------------------------------------ internals

    def _filesystem(self) -> Any:
        # A file system's event loop does not survive fork: each process makes its own.
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs_pid = os.getpid()
            self._fs = url_filesystem(self.manifest.location)
        return self._fs

    def _retrying(self, call: Callable[[], _T], url: str) -> _T:
        """``call()``, retried on a transient failure (see the module docstring) for up to ``retry_s``."""

        def count() -> None:
            with self._count_lock:
                self.counts["read_retries"] += 1

        return retrying(call, url, self.retry_s, count)

    def _open_shard(self, shard: ShardInfo) -> BinaryIO | None:
        """The shard open on this machine (the directory itself or a cached copy), or None: read it by range."""
        if self._pid != os.getpid():
            # A forked DataLoader worker inherits the parent's descriptors, whose file offsets the processes
            # would share: interleaved seek + read would return another process's bytes. Open our own.
            self._files, self._pid = {}, os.getpid()
        if not self.remote:
            return self._keep(self.manifest.shard_url(shard), lambda p: open_sized(p, shard.bytes))
        if self.cache is None or self._uncached.get(shard.sha256, 0.0) > time.monotonic():
            return None
        cache = self.cache
        opened = self._keep(
            shard.sha256, lambda _: cache.acquire(shard.sha256, shard.bytes, self._fetcher(shard))
        )
        return opened

    def _keep(
        self, name: str, open_fn: Callable[[str], BinaryIO | CachedShard | Uncached]
    ) -> BinaryIO | None:
        """The open file ``name`` (opened with ``open_fn`` if not yet), kept among the ``max_open`` most recent."""
        f = self._files.pop(name, None)
        if f is None:
            opened = open_fn(name)
            if isinstance(opened, Uncached):
                self._fallback(name, opened)
                return None
            if len(self._files) >= self.max_open:
                self._files.pop(next(iter(self._files))).close()
            f = opened
        self._files[name] = f  # most recently used last
        return f.file if isinstance(f, CachedShard) else f

    def _fallback(self, sha256: str, why: Uncached) -> None:
        self._uncached[sha256] = float("inf") if why.lasting else time.monotonic() + RECACHE_S
        self.counts["cache_fallbacks"] += 1
        log.warning(f"shard {sha256[:12]}... is not cached ({why.reason}); reading it from the source")

    def _fetcher(self, shard: ShardInfo) -> Callable[[Path], bool]:
        """Download the whole shard to a path; True when it matches the manifest's sha256."""
        url = self.manifest.shard_url(shard)

        def fetch(path: Path) -> bool:
            self._retrying(lambda: self._filesystem().get_file(url, str(path)), url)
            return sha256_file(path) == shard.sha256

        return fetch


def _usable_cache(cache_dir: str | os.PathLike[str] | ShardCache, location: str) -> ShardCache | None:
    """The cache of ``cache_dir``, or None (said in one log line) when it cannot be used on this machine."""
    try:
        cache = cache_dir if isinstance(cache_dir, ShardCache) else ShardCache(cache_dir)
        problem = cache.unusable()
    except OSError as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem is None:
        return cache
    directory = cache_dir.directory if isinstance(cache_dir, ShardCache) else os.fspath(cache_dir)
    log.warning(
        f"data.cache_dir {directory} cannot be used here ({problem}); the shards of {location} are read "
        "without a cache (set data.cache_dir=DIR to a writable local directory, or '' for none)"
    )
    return None
