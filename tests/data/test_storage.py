"""Shards served over HTTP from 127.0.0.1 (``ddp-rank shards serve``: Range requests honoured), with and without
the node-local cache: the same batches as from the local directory, and every fault counted or named."""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.eval_reader import EvalShards
from ddp_rank.data.reading.loader import StreamLoader
from ddp_rank.data.reading.serve import serve_directory
from ddp_rank.data.reading.stream import DataError, ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig

# Tests of seconds (a local HTTP server and DataLoader workers): in make test, out of make test-fast.
pytestmark = pytest.mark.slow

TINY = TransformConfig(resize=8, crop=6)
SCHEDULE = ScheduleConfig(batches_per_pair=4, seed=3)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("http")
    write_image_folder(root / "images", [[2, 3, 4, 5, 3] * 3] * 3, image_size=8)
    build_shards(
        read_image_folder(root / "images"), root / "shards", BuildOptions(max_samples=10, progress=False)
    )
    return root / "shards"


@pytest.fixture
def served(local: Path, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A copy of the shards (tests may damage it) behind http://127.0.0.1:PORT/ (Range requests honoured)."""
    copy = tmp_path / "served"
    shutil.copytree(local, copy)
    with serve_directory(copy) as url:
        yield copy, url


def batches(location: str | Path, world: int = 1, **kwargs: object) -> list[list[dict]]:
    out = []
    for rank in range(world):
        stream = ShardStream(
            location,
            12,
            rank=rank,
            world_size=world,
            schedule=SCHEDULE,
            transform=TINY,
            **kwargs,  # type: ignore[arg-type]
        )
        out.append(list(stream.iter_worker(0, 1)))
    return out


def same(a: list[list[dict]], b: list[list[dict]]) -> bool:
    return all(
        x.keys == y.keys and torch.equal(x.images, y.images)
        for ra, rb in zip(a, b)
        for x, y in zip(ra, rb)
    ) and [len(r) for r in a] == [len(r) for r in b]


def test_http_gives_the_same_batches_as_the_local_directory(local: Path, served: tuple[Path, str]) -> None:
    _, url = served
    assert Manifest.load(url).root == url
    assert same(batches(url, world=2), batches(local, world=2))
    reader = EvalShards(url, split="train", batch_size=7, transform=TINY)
    local_reader = EvalShards(local, split="train", batch_size=7, transform=TINY)
    remote_keys = [k for b in reader.iter_worker(0, 1) for k in b.keys]
    assert remote_keys == [k for b in local_reader.iter_worker(0, 1) for k in b.keys]
    assert len(remote_keys) == Manifest.load(local).split("train").samples


def test_real_dataloader_workers_read_over_http(local: Path, served: tuple[Path, str]) -> None:
    _, url = served
    stream = ShardStream(url, 12, rank=0, world_size=1, num_workers=2, schedule=SCHEDULE, transform=TINY)
    stream.batch(0, 3)  # the parent reads first: forked workers must not reuse its connections
    got = [b.keys for b in StreamLoader(stream)]
    assert got == [b.keys for b in batches(local)[0]]


def test_node_local_cache_fetches_each_shard_once_and_is_checked(
    local: Path, served: tuple[Path, str], tmp_path: Path
) -> None:
    copy, url = served
    cache = tmp_path / "cache"
    first = batches(url, cache_dir=cache)
    manifest = Manifest.load(local)
    cached = {p.name for p in cache.glob("*.tar")}
    used = {s.sha256 + ".tar" for s in manifest.split("train").shards}
    assert cached and cached <= used
    assert same(first, batches(local))
    for tar in copy.rglob("*.tar"):  # the server has no shard left: this epoch reads the node's copies only
        tar.unlink()
    assert same(batches(url, cache_dir=cache), first)


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_http_faults_are_replaced_and_counted(
    served: tuple[Path, str], how: str, ddp_rank_log: pytest.LogCaptureFixture
) -> None:
    copy, url = served
    shard = Manifest.load(copy).split("train").shards[0]
    path = copy / shard.path
    data = bytearray(path.read_bytes())
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(bytes(data[: shard.classes[-1].offset + 100]))
    else:
        data[shard.classes[0].offset + 600] ^= 0x55
        path.write_bytes(bytes(data))
    ranks = batches(url, world=2)
    assert any(shard.path in r.getMessage() for r in ddp_rank_log.records)
    events = [b.events for r in ranks for b in r]
    assert sum(e.replaced_classes for e in events) > 0
    assert {s for e in events for s in e.bad_shards} == {shard.path}
    for step in zip(*ranks):
        keys = [k for b in step for k in b.keys]
        assert len(keys) == len(set(keys)) == 12


def test_http_with_nothing_left_to_replace_names_the_shards(served: tuple[Path, str]) -> None:
    copy, url = served
    gone = [s.path for s in Manifest.load(copy).split("train").shards if s.category == 1]
    for name in gone:
        (copy / name).unlink()
    with pytest.raises(DataError, match="no readable replacement") as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batches(url)
    assert any(name in str(info.value) for name in gone)


def test_a_missing_manifest_url_says_what_to_do(served: tuple[Path, str]) -> None:
    _, url = served
    with pytest.raises(FileNotFoundError, match="shards build"):
        Manifest.load(url + "/nowhere")


def test_ranges_are_served_as_object_stores_serve_them(local: Path) -> None:
    import urllib.error
    import urllib.request

    shard = Manifest.load(local).split("train").shards[0]
    with serve_directory(local) as url:
        request = urllib.request.Request(f"{url}/{shard.path}", headers={"Range": "bytes=512-1023"})
        with urllib.request.urlopen(request) as response:
            assert response.status == 206 and response.headers["Content-Range"].startswith("bytes 512-1023/")
            assert response.read() == (local / shard.path).read_bytes()[512:1024]
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(f"{url}/train/none.tar")
