"""The bounded node-local shard cache: least recently used shards go first, a shard some process holds open is never
evicted, several processes filling one cache stay under its cap and read the right bytes, and a shard that does
not fit (too large, the cap held open, the disk full) is read by range from the source and counted."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import multiprocessing as mp
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.serve import serve_directory
from ddp_rank.data.reading.shard_cache import CachedShard, ShardCache, Uncached, auto_cap_bytes, open_cache
from ddp_rank.data.reading.storage import ShardStore
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import TransformConfig

SIZE = 100


def _writer(content: bytes):
    def fetch(path: Path) -> bool:
        path.write_bytes(content)
        return True

    return fetch


def _put(cache: ShardCache, key: str) -> CachedShard:
    shard = cache.acquire(key, SIZE, _writer(key.encode() * (SIZE // len(key))))
    assert isinstance(shard, CachedShard), shard
    return shard


def _cached_size(directory: Path) -> int:
    """Bytes of the shards in ``directory`` now (one another process evicts between the listing and the stat
    counts as gone)."""
    total = 0
    for path in directory.glob("*.tar"):
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_size
    return total


def _cached(directory: Path) -> set[str]:
    return {p.stem for p in directory.glob("*.tar")}


# ----------------------------------------------------------------------------------------- one process
def test_least_recently_used_shards_are_evicted_first(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=3 * SIZE)
    for i, key in enumerate(["aa", "bb", "cc"]):
        _put(cache, key).close()
        os.utime(tmp_path / f"{key}.tar", (1000 + i, 1000 + i))  # distinct, ordered last uses
    _put(cache, "aa").close()  # used again: now the most recent
    _put(cache, "dd").close()
    assert _cached(tmp_path) == {"aa", "cc", "dd"}  # bb, the least recently used, went
    _put(cache, "ee").close()
    assert _cached(tmp_path) == {"aa", "dd", "ee"}
    assert cache.cached_bytes() == 3 * SIZE
    reopened = _put(cache, "aa")
    assert reopened.file.read() == b"aa" * (SIZE // 2)
    reopened.close()


def test_a_shard_larger_than_the_cap_or_a_mismatched_download_is_not_cached(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path, max_bytes=SIZE - 1)
    assert cache.acquire("aa", SIZE, _writer(b"x" * SIZE)) == Uncached(
        f"{SIZE} bytes exceed the cache cap of {SIZE - 1}", lasting=True
    )
    big = ShardCache(tmp_path, max_bytes=10 * SIZE)
    mismatch = big.acquire("bb", SIZE, lambda path: path.write_bytes(b"x") is None and False)
    assert isinstance(mismatch, Uncached) and mismatch.lasting and "sha256" in mismatch.reason
    assert list(tmp_path.glob("*.tar")) == [] and list(tmp_path.glob("*.partial")) == []


def test_a_full_disk_leaves_no_partial_shard_and_says_so(tmp_path: Path) -> None:
    def disk_full(path: Path) -> bool:
        path.write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    result = ShardCache(tmp_path, max_bytes=10 * SIZE).acquire("aa", SIZE, disk_full)
    assert isinstance(result, Uncached) and not result.lasting and "disk is full" in result.reason
    assert [p.name for p in tmp_path.iterdir() if p.suffix not in (".lock", ".fetch")] == []


def test_the_automatic_cap_is_half_the_free_space(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    assert abs(auto_cap_bytes(tmp_path / "not" / "yet") - free / 2) < 0.01 * free
    assert not (tmp_path / "not").exists()  # measuring creates nothing
    assert open_cache("", 1.0) is None
    capped = open_cache(tmp_path, 0.5)
    assert capped is not None and capped.max_bytes == 500_000_000


def _killed_while_downloading(directory: str, key: str) -> None:
    def fetch(path: Path) -> bool:
        path.write_bytes(b"x" * (SIZE // 2))
        os._exit(75)  # a second signal, the grace period, SIGKILL: no cleanup runs

    ShardCache(directory, max_bytes=3 * SIZE).acquire(key, SIZE, fetch)


def test_half_downloads_of_killed_processes_are_removed_unless_their_download_runs(tmp_path: Path) -> None:
    """A process killed during a download leaves ``.KEY.PID.partial``: the next download of that shard removes
    it, and any download removes those of other shards whose download lock nobody holds, so they do not pile up
    past the cap across preemptions. A download in progress keeps its own."""
    killed = mp.get_context("fork").Process(target=_killed_while_downloading, args=(str(tmp_path), "aa"))
    killed.start()
    killed.join(60)
    assert killed.exitcode == 75
    assert [p.name for p in tmp_path.glob("*.partial")] == [f".aa.{killed.pid}.partial"]
    (tmp_path / ".bb.999999.partial").write_bytes(b"x" * SIZE)  # another shard's, from another killed process
    (tmp_path / ".cc.999998.partial").write_bytes(b"x" * SIZE)
    cache = ShardCache(tmp_path, max_bytes=3 * SIZE)
    with open(tmp_path / "cc.fetch", "a+b") as downloading:
        fcntl.flock(downloading, fcntl.LOCK_EX)  # cc's download runs (its lock is held)
        _put(cache, "dd").close()
        assert [p.name for p in tmp_path.glob("*.partial")] == [".cc.999998.partial"]
    _put(cache, "aa").close()
    assert list(tmp_path.glob("*.partial")) == [] and list(tmp_path.glob("*.reserve")) == []
    assert _cached(tmp_path) == {"aa", "dd"}
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == 2 * SIZE  # lock files are empty


def test_a_new_download_of_a_shard_removes_its_own_half_download(tmp_path: Path) -> None:
    (tmp_path / ".aa.999999.partial").write_bytes(b"x" * SIZE)
    _put(ShardCache(tmp_path, max_bytes=SIZE), "aa").close()
    assert list(tmp_path.glob("*.partial")) == []


# ----------------------------------------------------------------------------------------- several processes
def _hold(directory: str, key: str, held: Any, release: Any) -> None:
    shard = _put(ShardCache(directory, max_bytes=2 * SIZE), key)
    held.set()
    release.wait(60)
    shard.close()


@pytest.mark.slow
def test_a_shard_another_process_holds_open_is_never_evicted(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), "aa", held, release))
    holder.start()
    try:
        assert held.wait(60), "the holding process did not start"
        cache = ShardCache(tmp_path, max_bytes=2 * SIZE)
        for key in ["bb", "cc", "dd"]:  # room for one besides the held one: each evicts the previous
            _put(cache, key).close()
            assert _cached(tmp_path) == {"aa", key}
        mine = _put(cache, "ee")  # now this process holds one too: the cap is all held
        full = cache.acquire("ff", SIZE, _writer(b"f" * SIZE))
        assert isinstance(full, Uncached) and not full.lasting and "hold open" in full.reason
        mine.close()
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0
    _put(cache, "ff").close()  # released: the least recently used of the two goes
    assert _cached(tmp_path) == {"ee", "ff"}


@pytest.mark.slow
def test_a_reader_of_a_shard_another_process_holds_open_does_not_wait_for_it(tmp_path: Path) -> None:
    """The holder downloaded ``aa`` and keeps it open: a second reader of ``aa`` opens it at once."""
    import threading

    ctx = mp.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(str(tmp_path), "aa", held, release))
    holder.start()
    try:
        assert held.wait(60), "the holding process did not start"
        got: list[CachedShard | Uncached] = []
        reader = threading.Thread(
            target=lambda: got.append(
                ShardCache(tmp_path, max_bytes=2 * SIZE).acquire("aa", SIZE, _writer(b"never used"))
            ),
            daemon=True,
        )
        reader.start()
        reader.join(20)
        assert got, "the second reader waited for the holder to close the shard"
        assert isinstance(got[0], CachedShard) and got[0].file.read() == b"aa" * (SIZE // 2)
        got[0].close()
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cache-shards")
    write_image_folder(root / "images", [[2, 3, 4, 5, 3] * 3] * 3, image_size=8)
    build_shards(
        read_image_folder(root / "images"), root / "shards", BuildOptions(max_samples=10, progress=False)
    )
    return root / "shards"


@pytest.fixture
def served(shards: Path) -> Iterator[str]:
    with serve_directory(shards) as url:
        yield url


def _read_everything(url: str, local: str, cache_dir: str, cap: int, seed: int) -> dict[str, int]:
    """Every class of every shard, in an order of its own, through a capped cache; checked against ``local``."""
    import random

    manifest, local_manifest = Manifest.load(url), Manifest.load(local)
    store = ShardStore(manifest, cache_dir=ShardCache(cache_dir, max_bytes=cap), max_open=1)
    reads = [(s, c) for s in manifest.split("train").shards for c in s.classes] * 2
    random.Random(seed).shuffle(reads)
    for shard, span in reads:
        data = store.read(shard, span.offset, span.length)
        with open(local_manifest.shard_url(shard), "rb") as f:
            f.seek(span.offset)
            assert data == f.read(span.length), f"wrong bytes for class {span.id} of {shard.path}"
    store.close()
    return store.take_counts()


@pytest.mark.slow
def test_several_processes_filling_one_cache_stay_under_the_cap_and_read_the_right_bytes(
    shards: Path, served: str, tmp_path: Path
) -> None:
    sizes = sorted(s.bytes for s in Manifest.load(shards).split("train").shards)
    cap = sizes[-1] + sizes[-2] + sizes[-3] // 2  # about two and a half shards of many
    assert len(sizes) > 6
    cache_dir = tmp_path / "cache"
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        pending = pool.starmap_async(
            _read_everything, [(served, str(shards), str(cache_dir), cap, seed) for seed in range(4)]
        )
        peak = 0
        while not pending.ready():
            peak = max(peak, _cached_size(cache_dir))
            time.sleep(0.005)
        counts = pending.get(120)
    assert 0 < peak <= cap
    assert ShardCache(cache_dir, max_bytes=cap).cached_bytes() <= cap
    assert list(cache_dir.glob("*.partial")) == [] and list(cache_dir.glob("*.reserve")) == []
    assert all(c["read_retries"] == 0 for c in counts)


def test_a_full_disk_falls_back_to_ranged_reads_with_the_same_batches(
    shards: Path, served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(self: ShardStore, shard: object):
        def fetch(path: Path) -> bool:
            path.write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return fetch

    tiny = TransformConfig(resize=8, crop=6)

    def all_batches(location: str | Path, **kwargs: object) -> list[dict]:
        return list(ShardStream(location, 12, transform=tiny, **kwargs).iter_worker(0, 1))  # type: ignore[arg-type]

    expected = all_batches(shards)
    monkeypatch.setattr(ShardStore, "_fetcher", no_space)
    got = all_batches(served, cache_dir=tmp_path / "cache")
    assert [b.keys for b in got] == [b.keys for b in expected]
    assert all(b.events.replaced_classes == 0 for b in got)
    fallbacks = sum(b.events.cache_fallbacks for b in got)
    where = ShardStream(shards, 12).reader.where
    used = {shard.path for b in expected for label in b.labels.tolist() for shard, _ in where[label]}
    assert fallbacks == len(used)  # once per shard: the next reads go straight to the source
    assert (
        list((tmp_path / "cache").glob("*.tar")) == [] and list((tmp_path / "cache").glob("*.partial")) == []
    )


def test_a_cache_dir_that_cannot_be_made_is_said_once_and_training_reads_without_it(
    shards: Path, served: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run's data.cache_dir that this machine cannot make (here: under a file) costs the cache, said once when
    the reader is made, not each class of each shard replaced as unreadable."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    tiny = TransformConfig(resize=8, crop=6)

    def all_batches(location: str | Path, **kwargs: object) -> list[dict]:
        return list(ShardStream(location, 12, transform=tiny, **kwargs).iter_worker(0, 1))  # type: ignore[arg-type]

    expected = all_batches(shards)
    with caplog.at_level("WARNING", logger="ddp_rank.data.reading.storage"):
        got = all_batches(served, cache_dir=blocker / "cache")
    assert [b.keys for b in got] == [b.keys for b in expected]
    assert all(b.events.replaced_classes == 0 and b.events.cache_fallbacks == 0 for b in got)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith(f"data.cache_dir {blocker / 'cache'} cannot be used here"), (
        said
    )
