"""Ranged reads of shard bytes from a local directory or any URL fsspec reaches, with an optional node-local cache.

A class is one byte range of one tar (``ClassSpan``), so training reads are ``read(shard, offset, length)``:
a ``seek`` + ``read`` on a local file, an HTTP ``Range`` request (or the S3 / GCS equivalent) through fsspec
for a URL. We write no network client: fsspec's file systems (``http``/``https`` need aiohttp, ``s3`` s3fs,
``gs`` gcsfs) do the transfer.

The node-local cache (``cache_dir``) keeps whole shards fetched from a URL, since every class of a shard is read
again each epoch. It is ours rather than fsspec's ``simplecache`` because that one writes the download in place
(another process on the node can read a half-written file as cached) and checks nothing; here a shard is
downloaded once per node under a file lock, to a temporary name, checked against the manifest's sha256 and only
then renamed into place, content-addressed by that sha256 (a rebuilt shard never reads a stale copy). A shard
whose download does not match is not cached; its classes are then read by range and checked one by one.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any, BinaryIO

from ddp_rank.data.manifest import Manifest, ShardInfo, is_url, sha256_file


class ShardStore:
    """Reads byte ranges of a manifest's shards. Picklable: DataLoader workers open their own files."""

    def __init__(
        self, manifest: Manifest, cache_dir: str | os.PathLike[str] | None = None, max_open: int = 16
    ):
        self.manifest = manifest
        self.remote = is_url(manifest.location)
        self.cache_dir = Path(cache_dir) if cache_dir and self.remote else None
        self.max_open = max_open
        self._files: dict[str, BinaryIO] = {}
        self._pid = os.getpid()
        self._fs: Any = None
        self._fs_pid = os.getpid()
        self._uncacheable: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"], state["_fs"] = {}, None
        return state

    def read(self, shard: ShardInfo, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of ``shard``; raises OSError (FileNotFoundError for a missing shard,
        EOFError for a short read) or whatever the storage raises."""
        path = self._local_path(shard)
        if path is None:
            data = self._filesystem().cat_file(
                self.manifest.shard_url(shard), start=offset, end=offset + length
            )
        else:
            f = self._open(path)
            f.seek(offset)
            data = f.read(length)
        if len(data) != length:
            raise EOFError(
                f"{shard.path}: {len(data)} of {length} bytes at offset {offset} (truncated shard?)"
            )
        return bytes(data)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    # ------------------------------------------------------------------ internals

    def _filesystem(self) -> Any:
        # A file system's event loop does not survive fork: each process makes its own.
        if self._fs is None or self._fs_pid != os.getpid():
            self._fs_pid = os.getpid()
            import fsspec

            self._fs = fsspec.core.url_to_fs(self.manifest.location)[0]
        return self._fs

    def _open(self, path: str) -> BinaryIO:
        if self._pid != os.getpid():
            # A forked DataLoader worker inherits the parent's descriptors, whose file offsets the processes
            # would share: interleaved seek + read would return another process's bytes. Open our own.
            self._files, self._pid = {}, os.getpid()
        f = self._files.pop(path, None)
        if f is None:
            if len(self._files) >= self.max_open:
                self._files.pop(next(iter(self._files))).close()
            f = open(path, "rb")  # noqa: SIM115 - kept open across reads, closed in close()
        self._files[path] = f  # most recently used last
        return f

    def _local_path(self, shard: ShardInfo) -> str | None:
        """Where to read the shard on this machine: the directory itself, a cached copy, or None (by range)."""
        if not self.remote:
            return self.manifest.shard_url(shard)
        if self.cache_dir is None or shard.sha256 in self._uncacheable:
            return None
        cached = self.cache_dir / f"{shard.sha256}.tar"
        if not cached.is_file() and not self._download(shard, cached):
            self._uncacheable.add(shard.sha256)
            return None
        return str(cached)

    def _download(self, shard: ShardInfo, cached: Path) -> bool:
        """Fetch a whole shard into the cache, once per node (file lock), checked; False if it does not match."""
        cached.parent.mkdir(parents=True, exist_ok=True)
        with open(cached.with_suffix(".lock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if cached.is_file():  # another process of this node fetched it while we waited
                return True
            partial = cached.with_name(f".{cached.name}.{os.getpid()}.partial")
            try:
                self._filesystem().get_file(self.manifest.shard_url(shard), str(partial))
                if sha256_file(partial) != shard.sha256:
                    return False
                os.replace(partial, cached)
            finally:
                partial.unlink(missing_ok=True)
        return True
