"""A bounded node-local cache of whole shards, shared by every process of a node (jobs, ranks, DataLoader workers).

Files in the cache directory, for a shard whose sha256 is ``KEY``:

- ``KEY.tar``: the shard, complete and checked (written to a temporary name, then ``os.replace``-d into place, so
  a killed process never leaves a partial shard under this name). Its mtime is its last use (least recently used
  goes first).
- ``KEY.lock``: the readers' lock. A reader holds a shared ``flock`` on it while it keeps the shard open (and while
  it waits for or does the shard's download). Eviction takes it with ``LOCK_EX | LOCK_NB`` and skips the shard
  when that fails, so a shard some process holds open is never evicted.
- ``KEY.fetch``: the download lock, held exclusively by the one process of the node that downloads the shard.
  Lock files stay (0 bytes): unlinking a lock file others may have opened would give two processes two locks.
- ``KEY.reserve``: the size of a download in progress, so that concurrent downloads together stay under the cap.
  A reservation whose ``KEY.fetch`` nobody holds is left over from a killed process and is removed.
- ``.KEY.PID.partial``: a download in progress (counted in its reservation). One whose ``KEY.fetch`` nobody holds
  is the half of a shard a killed process left (a second signal, a grace period, SIGKILL), and is removed by the
  next download of that shard, or of any shard (under the cache lock, as a reservation is).
- ``.cache.lock``: held exclusively while space is made and reserved, and while a finished download's bytes move
  from its reservation to its shard (a few file-system calls each).

``acquire`` returns the shard open (``CachedShard``) or says why it cannot (``Uncached``): larger than the cap,
the cap filled by shards other readers hold open, or the disk full (``ENOSPC``); the caller then reads the
shard by range from its source. A cap of ``None`` means half of the file system's free space (plus what the cache
already holds), measured when the cache is made.

The directory must be node-local (a local disk, ``/tmp``, ``$SLURM_TMPDIR``) and used by one user. On NFS,
``flock`` becomes a POSIX lock of the whole file, which two descriptors of one process never contend for and which
closing any descriptor of the file releases; on Lustre it is refused or node-local, depending on the mount: the
rules above no longer hold. And a lock file or shard that another user created cannot be locked or removed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

AUTO_FRACTION = 0.5
"""Share of the cache file system's free space an automatic cap takes (the rest stays for everything else)."""


@dataclass(frozen=True)
class Uncached:
    """Why a shard is read from its source instead of the cache; ``lasting`` when asking again cannot help."""

    reason: str
    lasting: bool


class CachedShard:
    """An open cached shard; holds its shared lock (no eviction) until ``close``."""

    def __init__(self, path: Path, lock: BinaryIO) -> None:
        self.path = path
        self.file: BinaryIO = open(path, "rb")  # noqa: SIM115 - closed in close()
        self._lock = lock

    def close(self) -> None:
        self.file.close()
        self._lock.close()  # releases the shared flock


def auto_cap_bytes(directory: Path) -> int:
    """Half of the free space of ``directory``'s file system plus what the cache already holds. Never raises for a
    directory that cannot be made or entered (``os.path`` answers False there): ``ShardCache.unusable`` says why."""
    existing = directory
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    held = sum(_size(p) for p in directory.glob("*.tar")) if os.path.isdir(directory) else 0
    return int(AUTO_FRACTION * (shutil.disk_usage(existing).free + held))


def open_cache(directory: str | os.PathLike[str] | None, max_gb: float) -> ShardCache | None:
    """The cache of ``data.cache_dir`` / ``data.cache_max_gb`` (GB = 1e9 bytes; 0 = automatic), None without one."""
    if not directory:
        return None
    return ShardCache(directory, None if max_gb == 0 else int(max_gb * 1e9))


class ShardCache:
    """Whole shards in ``directory``, at most ``max_bytes`` in all (see the module docstring). Picklable."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = auto_cap_bytes(self.directory) if max_bytes is None else int(max_bytes)
        if self.max_bytes < 0:
            raise ValueError(f"cache cap must be >= 0 bytes, got {self.max_bytes}")

    def unusable(self) -> str | None:
        """Why this process cannot use the cache (its directory cannot be made, or a file in it written), or
        None; asked once by a reader before its first shard, so that the reason is said once."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.directory / ".cache.lock", "a+b"):
                pass
        except OSError as exc:
            return f"{type(exc).__name__}: {exc.strerror or exc}"
        return None

    def acquire(self, key: str, size: int, fetch: Callable[[Path], bool]) -> CachedShard | Uncached:
        """The shard ``key`` (``size`` bytes) open, downloaded first with ``fetch(path)`` if absent; ``fetch``
        returns False when what it wrote is not the shard (not cached, lasting)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if size > self.max_bytes:
            return Uncached(f"{size} bytes exceed the cache cap of {self.max_bytes}", lasting=True)
        target = self._tar(key)
        lock = open(self._lock_path(key), "a+b")  # noqa: SIM115 - handed to CachedShard or closed here
        try:
            # Held from here on: once the shard is in place (checked below, under this lock) it cannot be evicted.
            fcntl.flock(lock, fcntl.LOCK_SH)
            if not target.is_file():
                problem = self._fetch_once(key, size, fetch)
                if problem is not None:
                    lock.close()
                    return problem
            shard = CachedShard(target, lock)
        except BaseException:
            lock.close()
            raise
        os.utime(target)  # last use, for the LRU order
        return shard

    def cached_bytes(self) -> int:
        """Bytes of the complete shards in the cache."""
        return sum(_size(p) for p in self.directory.glob("*.tar"))

    # ------------------------------------------------------------------ internals

    def _tar(self, key: str) -> Path:
        return self.directory / f"{key}.tar"

    def _lock_path(self, key: str) -> Path:
        return self.directory / f"{key}.lock"

    def _fetch_once(self, key: str, size: int, fetch: Callable[[Path], bool]) -> Uncached | None:
        """Download the shard unless another process of the node does it meanwhile (they wait on ``KEY.fetch``,
        a lock apart from the readers' ``KEY.lock``, so that waiting never waits for a reader to close)."""
        with open(self.directory / f"{key}.fetch", "a+b") as fetch_lock:
            fcntl.flock(fetch_lock, fcntl.LOCK_EX)
            if self._tar(key).is_file():  # another process fetched it while we waited
                return None
            return self._download(key, size, fetch)

    def _download(self, key: str, size: int, fetch: Callable[[Path], bool]) -> Uncached | None:
        """With the shard's fetch lock held: reserve room, fetch, check, rename into place."""
        for stale in self.directory.glob(f".{key}.*.partial"):  # a killed process's: no other download runs
            stale.unlink(missing_ok=True)
        reservation = self.directory / f"{key}.reserve"
        if not self._reserve(key, size, reservation):
            return Uncached("the cache is full of shards other readers hold open", lasting=False)
        partial = self.directory / f".{key}.{os.getpid()}.partial"
        try:
            if not fetch(partial):
                return Uncached("the download does not match the manifest's sha256", lasting=True)
            # The bytes move from the reservation to the shard under the cache lock: a ``_reserve`` running
            # meanwhile would otherwise list the shards before the rename and the reservations after the unlink,
            # and count these bytes nowhere.
            with self._cache_locked():
                os.replace(partial, self._tar(key))
                reservation.unlink()
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return Uncached(f"the cache's disk is full ({exc.strerror})", lasting=False)
            raise
        finally:
            partial.unlink(missing_ok=True)
            reservation.unlink(missing_ok=True)
        return None

    def _reserve(self, key: str, size: int, reservation: Path) -> bool:
        """Evict least recently used shards nobody holds until ``size`` more bytes fit; record the reservation.
        Partial downloads of other shards that killed processes left are removed first."""
        with self._cache_locked():
            for partial in self.directory.glob(".*.partial"):
                owner = partial.name[1:].split(".", 1)[0]  # .KEY.PID.partial
                if owner != key:
                    with self._unless_downloading(owner) as orphaned:
                        if orphaned:
                            partial.unlink(missing_ok=True)
            used = sum(_size(p) for p in self.directory.glob("*.tar"))
            for other in self.directory.glob("*.reserve"):
                if other != reservation:
                    used += self._live_reservation(other)
            for victim in sorted(self.directory.glob("*.tar"), key=_mtime):
                if used + size <= self.max_bytes:
                    break
                if victim.stem != key:
                    used -= self._evict(victim)
            if used + size > self.max_bytes:
                return False
            reservation.write_text(str(size))
            return True

    @contextmanager
    def _cache_locked(self) -> Iterator[None]:
        """Hold ``.cache.lock`` exclusively: what the cache holds and reserves does not change meanwhile."""
        with open(self.directory / ".cache.lock", "a+b") as cache_lock:
            fcntl.flock(cache_lock, fcntl.LOCK_EX)
            yield

    def _evict(self, victim: Path) -> int:
        """Remove ``victim`` unless a reader holds it (its lock is taken); the bytes freed."""
        with open(self._lock_path(victim.stem), "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0
            size = _size(victim)
            victim.unlink(missing_ok=True)
        return size

    def _live_reservation(self, reservation: Path) -> int:
        """The bytes a download in progress reserved, or 0 (and the file removed) when its process is gone."""
        with self._unless_downloading(reservation.stem) as orphaned:
            if orphaned:
                reservation.unlink(missing_ok=True)
                return 0
        try:
            return int(reservation.read_text() or 0)
        except (OSError, ValueError):
            return 0

    @contextmanager
    def _unless_downloading(self, key: str) -> Iterator[bool]:
        """True, with ``KEY.fetch`` held meanwhile, when no process downloads the shard ``key``: what such a
        download left (a reservation, a partial file) is a killed process's and may go. False while one runs."""
        with open(self.directory / f"{key}.fetch", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                orphaned = True
            except BlockingIOError:  # the downloader holds it
                orphaned = False
            yield orphaned


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
