"""A remote read that fails on the way (the file server restarting, a connection dropped in the middle of a body,
an HTTP 5xx) is retried and counted, and gives the right bytes once the server is back; one that stays down past
``retry_s`` raises, and a missing shard or a refused request (4xx) is not retried."""

from __future__ import annotations

import dataclasses
import http.server
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest, ShardInfo
from ddp_rank.data.reading.serve import RangeRequestHandler, serve_directory
from ddp_rank.data.reading.storage import ShardStore

# Tests of seconds (a local HTTP server that restarts and drops connections): in make test, out of make test-fast.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("retry-shards")
    write_image_folder(root / "images", [[2, 3, 4]] * 2, image_size=8)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def _first_class(manifest: Manifest) -> tuple[ShardInfo, int, int]:
    shard = manifest.split("train").shards[0]
    return shard, shard.classes[0].offset, shard.classes[0].length


@pytest.mark.slow
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


@contextmanager
def _serve_with_faults(directory: Path, faults: list[str]) -> Iterator[str]:
    """``directory`` over HTTP on 127.0.0.1, where the first requests for a shard meet ``faults`` in order: "drop"
    (the answer stops half-way through the body its Content-Length announced, and the connection closes) or an
    HTTP status ("503")."""
    pending = list(faults)

    class Faulty(RangeRequestHandler):
        def send_head(self) -> Any:
            if self.path.endswith(".tar") and pending and pending[0] != "drop":
                self.send_error(int(pending.pop(0)))
                return None
            return super().send_head()

        def copyfile(self, source: Any, outputfile: Any) -> None:
            if self.path.endswith(".tar") and pending and pending[0] == "drop":
                pending.pop(0)
                body = source.read()
                outputfile.write(body[: len(body) // 2])  # HTTP/1.0: the connection closes after the answer
                return
            super().copyfile(source, outputfile)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(Faulty, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
    assert pending == [], "a fault was never met"


@pytest.mark.parametrize(
    ("fault", "cached"),
    [("drop", False), ("drop", True), ("503", False), ("429", False)],
    ids=["dropped mid-body", "dropped mid-download", "503", "429"],
)
def test_the_http_clients_transient_errors_are_retried(
    shards: Path, tmp_path: Path, fault: str, cached: bool
) -> None:
    """fsspec's HTTP file system raises aiohttp's errors as they are, and those are not OSErrors."""
    with _serve_with_faults(shards, [fault]) as url:
        manifest = Manifest.load(url)
        store = ShardStore(manifest, cache_dir=tmp_path / "cache" if cached else None, retry_s=5)
        shard, offset, length = _first_class(manifest)
        data = store.read(shard, offset, length)
    assert data == (shards / shard.path).read_bytes()[offset : offset + length]
    assert store.take_counts() == {"cache_fallbacks": 0, "read_retries": 1}


def test_a_refused_request_is_not_retried(shards: Path) -> None:
    with _serve_with_faults(shards, ["403"]) as url:
        manifest = Manifest.load(url)
        store = ShardStore(manifest, retry_s=5)
        with pytest.raises(aiohttp.ClientResponseError) as refused:
            store.read(*_first_class(manifest))
    assert refused.value.status == 403
    assert store.take_counts()["read_retries"] == 0
