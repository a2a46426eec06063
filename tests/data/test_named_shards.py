"""Shards named by a URL or a path pattern (``export --shards-url``, ``search --grid``) read through the checked
path: the manifest's size and sha256, the retries, the node-local cache, the tar walk's one-line faults."""

from __future__ import annotations

import ast
import gzip
import io
import json
import shutil
import tarfile
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import MANIFEST_NAME, Manifest
from ddp_rank.data.reading.named_shards import NamedShards, ShardReadError, ShardSample
from ddp_rank.data.reading.serve import RangeRequestHandler
from tests.helpers.quick_clock import QuickClock
from tests.helpers.quick_server import serve_quickly

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_rank"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("named-shards")
    write_image_folder(root / "images", [[2, 3, 4]] * 2, image_size=8)
    build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
    return root / "shards"


def _names(shards: Path) -> list[str]:
    return [s.path for s in Manifest.load(shards).split("train").shards]


def _read(named: NamedShards) -> list[ShardSample]:
    try:
        return [sample for url in named.urls for sample in named.samples(url)]
    finally:
        named.close()


def _expected(shards: Path) -> list[tuple[str, dict[str, bytes]]]:
    """Every sample's key and its image, .cls and .json bytes, as tarfile reads the shards."""
    out: list[tuple[str, dict[str, bytes]]] = []
    for name in _names(shards):
        with tarfile.open(shards / name) as tar:
            for info in tar:
                key, ext = info.name.split(".", 1)
                if not out or out[-1][0] != key:
                    out.append((key, {}))
                data = tar.extractfile(info)
                assert data is not None
                out[-1][1][ext] = data.read()
    return out


def _damage_an_image(tar: Path) -> None:
    """Flip one byte inside the first image's data: the tar stays sound, its sha256 changes."""
    with tarfile.open(tar) as t:
        member = next(m for m in t.getmembers() if m.name.endswith((".png", ".jpg")))
    data = bytearray(tar.read_bytes())
    data[member.offset_data + 20] ^= 0xFF
    tar.write_bytes(bytes(data))


def _break_second_header(tar: Path) -> int:
    """Garble the header of the tar's second member; returns its byte offset."""
    with tarfile.open(tar) as t:
        second = t.getmembers()[1].offset
    data = bytearray(tar.read_bytes())
    data[second : second + 8] = b"garbage!"
    tar.write_bytes(bytes(data))
    return second


def test_shards_over_http_read_as_the_local_files_checked_and_cached(shards: Path, tmp_path: Path) -> None:
    names = _names(shards)
    local = _read(NamedShards("::".join(str(shards / n) for n in names)))
    assert [(s.key, s.members) for s in local] == _expected(shards)
    with serve_quickly(shards) as url:
        named = NamedShards("::".join(f"{url}/{n}" for n in names), cache_dir=tmp_path / "cache")
        assert set(named.listed) == set(named.urls)  # the manifest above the split's folder lists them
        remote = _read(named)
    assert remote == local
    shas = {s.sha256 for s in Manifest.load(shards).split("train").shards}
    assert {p.stem for p in (tmp_path / "cache").glob("*.tar")} == shas


@pytest.mark.parametrize("cached", [False, True], ids=["downloaded", "cache"])
def test_a_shard_whose_sha256_is_not_the_manifests_is_refused(
    shards: Path, tmp_path: Path, cached: bool
) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    name = _names(copy)[0]
    _damage_an_image(copy / name)
    with serve_quickly(copy) as url:
        named = NamedShards(f"{url}/{name}", cache_dir=tmp_path / "cache" if cached else None)
        with pytest.raises(ShardReadError) as caught:
            _read(named)
    message = str(caught.value)
    assert f"shard {url}/{name}: its sha256 differs from the manifest's" in message and "\n" not in message
    assert "`ddp-rank shards build`" in message
    assert not list((tmp_path / "cache").glob("*.tar"))  # nothing unchecked is kept
    with pytest.raises(ShardReadError, match="sha256 differs"):
        _read(NamedShards(str(copy / name)))


def test_a_corrupt_tar_without_a_manifest_is_named_in_one_line(shards: Path, tmp_path: Path) -> None:
    folder = tmp_path / "plain"
    folder.mkdir()
    name = _names(shards)[0]
    tar = folder / Path(name).name
    shutil.copy(shards / name, tar)
    at = _break_second_header(tar)
    with serve_quickly(folder) as url:
        named = NamedShards(f"{url}/{tar.name}")
        assert named.listed == {}
        with pytest.raises(ShardReadError) as caught:
            _read(named)
    message = str(caught.value)
    assert message.startswith(f"shard {url}/{tar.name}: corrupt tar header at byte {at}")
    assert "replace it with a sound copy, or leave it out of the pattern" in message and "\n" not in message


def test_a_compressed_shard_reads_as_its_tar_and_a_cut_one_is_named(shards: Path, tmp_path: Path) -> None:
    name = _names(shards)[0]
    plain = shards / name
    packed = tmp_path / "x-000000.tar.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    with serve_quickly(tmp_path) as url:
        assert _read(NamedShards(f"{url}/{packed.name}")) == _read(NamedShards(str(plain)))
    cut = tmp_path / "cut-000000.tar.gz"
    cut.write_bytes(packed.read_bytes()[:200])
    with pytest.raises(ShardReadError, match=f"shard {cut}: the gzip stream does not decompress"):
        _read(NamedShards(str(cut)))


def test_a_manifest_that_lists_only_some_of_the_shards_is_refused(shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    first = _names(copy)[0]
    extra = copy / Path(first).parent / "extra-000000.tar"
    shutil.copy(copy / first, extra)
    with pytest.raises(ShardReadError) as caught:
        NamedShards(f"{copy / first}::{extra}")
    assert f"shard {extra} is not listed in {copy / MANIFEST_NAME}, which lists 1 of the 2" in str(
        caught.value
    )


def test_a_missing_shard_is_named(shards: Path) -> None:
    with serve_quickly(shards) as url:
        named = NamedShards(f"{url}/train/nowhere-{{0..1}}.tar")
        with pytest.raises(ShardReadError, match=rf"shard {url}/train/nowhere-0.tar: no such shard; fix"):
            _read(named)


def _serve_failing_first(directory: Path, status: int) -> AbstractContextManager[str]:
    """``directory`` over HTTP, the first request for a tar answered with ``status``."""
    failed: list[str] = []

    class Flaky(RangeRequestHandler):
        def send_head(self) -> Any:
            if self.path.endswith(".tar") and not failed:
                failed.append(self.path)
                self.send_error(status)
                return None
            return super().send_head()

    return serve_quickly(directory, Flaky, failed)


def test_a_transient_http_error_is_retried(shards: Path, tmp_path: Path, quick_retries: QuickClock) -> None:
    name = _names(shards)[0]
    folder = tmp_path / "plain"  # no manifest: the retries hold for other tools' shards too
    folder.mkdir()
    shutil.copy(shards / name, folder / "a-0.tar")
    with _serve_failing_first(folder, 503) as url:
        samples = _read(NamedShards(f"{url}/a-0.tar", retry_s=5))
    assert samples == _read(NamedShards(str(shards / name)))
    assert len(quick_retries.pauses) == 1


def test_no_module_of_ddp_rank_reads_shards_through_webdataset() -> None:
    """Every read of shards goes through the data layer's checked reader; webdataset is not imported at all."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if "webdataset" not in text:  # no import of it then: parse only the files that name it
            continue
        for node in ast.walk(ast.parse(text, str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            found += [
                f"{path.relative_to(PACKAGE)}:{node.lineno}" for n in names if n.split(".")[0] == "webdataset"
            ]
    assert found == [], f"webdataset imported in {found}; read shards through ddp_rank.data"


def test_a_gzip_named_tar_is_told_by_its_bytes(shards: Path, tmp_path: Path) -> None:
    name = _names(shards)[0]
    odd = tmp_path / "odd-000000.tar"
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as out:
        out.write((shards / name).read_bytes())
    odd.write_bytes(buffer.getvalue())
    assert _read(NamedShards(str(odd))) == _read(NamedShards(str(shards / name)))


def _serve_failing(directory: Path, status: int, path: str, times: int) -> AbstractContextManager[str]:
    """``directory`` over HTTP, the first ``times`` requests for ``path`` answered with ``status``."""
    failed: list[str] = []

    class Flaky(RangeRequestHandler):
        def send_head(self) -> Any:
            if self.path == path and len(failed) < times:
                failed.append(self.path)
                self.send_error(status)
                return None
            return super().send_head()

    return serve_quickly(directory, Flaky, failed)


def test_a_manifest_answered_503_is_retried_so_a_tampered_shard_is_still_refused(
    shards: Path, tmp_path: Path, quick_retries: QuickClock
) -> None:
    """fsspec's HTTP ``info`` turns a 5xx into FileNotFoundError: read that way, a busy server would make the
    shards look manifest-less and a replaced one would be read unchecked."""
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    name = _names(copy)[0]
    _damage_an_image(copy / name)
    with _serve_failing(copy, 503, f"/{MANIFEST_NAME}", times=2) as url:
        named = NamedShards(f"{url}/{name}", retry_s=10)
        assert set(named.listed) == {f"{url}/{name}"}
        with pytest.raises(ShardReadError, match="sha256 differs"):
            _read(named)
    assert len(quick_retries.pauses) == 2


@pytest.mark.parametrize("status", [503, 403])
def test_a_manifest_that_cannot_be_fetched_is_an_error_naming_it(
    shards: Path, tmp_path: Path, status: int, quick_retries: QuickClock
) -> None:
    name = _names(shards)[0]
    with (
        _serve_failing(shards, status, f"/{MANIFEST_NAME}", times=1000) as url,
        pytest.raises(ShardReadError) as caught,
    ):
        NamedShards(f"{url}/{name}", retry_s=0.5)
    message = str(caught.value)
    assert message.startswith(f"{url}/{MANIFEST_NAME} cannot be read") and str(status) in message
    assert "\n" not in message
    assert bool(quick_retries.pauses) == (status == 503)  # retried until retry_s is spent; a 403 is not


@pytest.mark.parametrize(
    "text",
    ['{"name": "my-dataset", "files": 3}', "<html><body>Not here</body></html>", "[1, 2]"],
    ids=["other-json", "html", "not-an-object"],
)
@pytest.mark.parametrize("where", ["folder", "above"])
def test_an_unrelated_manifest_json_means_no_manifest(
    shards: Path, tmp_path: Path, text: str, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "plain" / "sub"
    folder.mkdir(parents=True)
    name = _names(shards)[0]
    shutil.copy(shards / name, folder / "a-0.tar")
    (folder if where == "folder" else folder.parent).joinpath(MANIFEST_NAME).write_text(text)
    expected = _read(NamedShards(str(shards / name)))
    caplog.set_level("INFO", logger="ddp_rank.data.reading.named_shards")
    local = NamedShards(str(folder / "a-0.tar"))
    assert local.listed == {}
    assert _read(local) == expected
    assert "is not a ddp_rank shard manifest" in caplog.text
    with serve_quickly(tmp_path / "plain") as url:
        assert _read(NamedShards(f"{url}/sub/a-0.tar")) == expected


def test_a_ddp_rank_manifest_that_fails_its_checks_is_still_refused(shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy)
    name = _names(copy)[0]
    data = json.loads((copy / MANIFEST_NAME).read_text())
    data["categories"] = 7
    (copy / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(ShardReadError, match=f"{MANIFEST_NAME}: categories: the number 7"):
        NamedShards(str(copy / name))


def test_a_file_url_pattern_reads_as_the_path(shards: Path) -> None:
    names = _names(shards)
    named = NamedShards("::".join(f"file://{shards / n}" for n in names))
    assert set(named.listed) == set(named.urls)  # checked against the manifest like the path
    assert [(s.key, s.members) for s in _read(named)] == _expected(shards)


@pytest.mark.parametrize(
    ("pattern", "said"),
    [
        ("pipe:curl -s https://host/d/a-{0..1}.tar", "pipe:"),
        ("nosuchscheme://host/d/a-{0..1}.tar", "nosuchscheme://"),
        ("${WDS_ROOT}/a-{0..1}.tar", "${WDS_ROOT}"),
    ],
    ids=["pipe", "unknown-scheme", "env-var"],
)
def test_a_pattern_this_reader_cannot_read_is_refused_in_one_line(pattern: str, said: str) -> None:
    with pytest.raises(ShardReadError) as caught:
        NamedShards(f"/data/x.tar::{pattern}")
    message = str(caught.value)
    assert pattern in message and said in message and "\n" not in message


def test_a_cache_dir_that_cannot_be_made_reads_without_the_cache(
    shards: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The run's recorded data.cache_dir may not exist on the machine that exports: the shards are read all the
    same, and the reason is said once (not blamed on each shard)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    names = _names(shards)
    with serve_quickly(shards) as url, caplog.at_level("WARNING"):
        named = NamedShards("::".join(f"{url}/{n}" for n in names), cache_dir=blocker / "cache")
        assert _read(named) == _read(NamedShards("::".join(str(shards / n) for n in names)))
    said = [r.getMessage() for r in caplog.records if "cache" in r.getMessage()]
    assert len(said) == 1 and str(blocker / "cache") in said[0], said


def test_a_compressed_download_is_gone_once_it_is_decompressed(shards: Path, tmp_path: Path) -> None:
    """One shard at a time on the scratch disk: the compressed download goes as soon as its tar is written."""
    packed = tmp_path / "x-000000.tar.gz"
    packed.write_bytes(gzip.compress((shards / _names(shards)[0]).read_bytes()))
    with serve_quickly(tmp_path) as url:
        named = NamedShards(f"{url}/{packed.name}")
        try:
            reading = named.samples(named.urls[0])  # kept: a dropped generator closes its files at once
            first = next(reading)
            assert named._scratch is not None
            assert [p.name for p in Path(named._scratch.name).iterdir()] == ["plain.tar"]
            assert first.key
        finally:
            named.close()
