"""A remote read that fails on the way (the file server restarting) is retried and counted, and gives the right
bytes once the server is back; one that stays down past ``retry_s`` raises, and a missing shard is not retried."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest

from ddp_rank.data.build import BuildOptions, build_shards
from ddp_rank.data.listing import read_image_folder
from ddp_rank.data.manifest import Manifest, ShardInfo
from ddp_rank.data.serve import serve_directory
from ddp_rank.data.storage import ShardStore
from ddp_rank.data.synthetic import write_image_folder


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retry-shards")
    write_image_folder(root / "images", [[2, 3, 4]] * 2, image_size=8)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def _first_class(manifest: Manifest) -> tuple[ShardInfo, int, int]:
    shard = manifest.split("train").shards[0]
    return shard, shard.classes[0].offset, shard.classes[0].length


@pytest.mark.parametrize("cached", [False, True], ids=["ranged", "whole-shard download"])
def test_a_server_restart_costs_retries_not_data(shards: Path, tmp_path: Path, cached: bool) -> None:
    with serve_directory(shards) as url:
        manifest = Manifest.load(url)
    port = int(url.rsplit(":", 1)[1])
    back = threading.Event()

    def restart_later() -> None:
        time.sleep(1.0)
        with serve_directory(shards, port=port):
            back.set()
            time.sleep(30)

    threading.Thread(target=restart_later, daemon=True).start()
    store = ShardStore(manifest, cache_dir=tmp_path / "cache" if cached else None, retry_s=20)
    shard, offset, length = _first_class(manifest)
    data = store.read(shard, offset, length)
    assert back.is_set()
    expected = (shards / shard.path).read_bytes()[offset : offset + length]
    assert data == expected
    counts = store.take_counts()
    assert counts["read_retries"] >= 1 and counts["cache_fallbacks"] == 0
    assert store.take_counts()["read_retries"] == 0  # taken: counting starts again
    assert len(list((tmp_path / "cache").glob("*.tar"))) == (1 if cached else 0)


def test_a_server_down_past_the_retry_time_raises_and_a_missing_shard_is_not_retried(shards: Path) -> None:
    with serve_directory(shards) as url:
        manifest = Manifest.load(url)
        shard, offset, length = _first_class(manifest)
        missing = dataclasses.replace(shard, path="train/missing.tar")
        store = ShardStore(manifest, retry_s=5)
        with pytest.raises(FileNotFoundError):
            store.read(missing, offset, length)
        assert store.take_counts()["read_retries"] == 0
    store = ShardStore(manifest, retry_s=0.6)
    started = time.monotonic()
    with pytest.raises(OSError, match=r"[Cc]onnect"):
        store.read(shard, offset, length)
    assert time.monotonic() - started < 5
    assert store.take_counts()["read_retries"] >= 1
