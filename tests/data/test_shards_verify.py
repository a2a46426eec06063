"""``shards verify`` / ``shards info`` and the CLI around them."""

from __future__ import annotations

import io
import shutil
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.info import format_info
from ddp_rank.data.format.manifest import Manifest


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    write_image_folder(tmp_path / "img", [[2, 3, 4], [3, 3]], image_size=8)
    build_shards(
        read_image_folder(tmp_path / "img"), tmp_path / "s", BuildOptions(max_samples=5, progress=False)
    )
    return tmp_path / "s"


def test_sound_directory_has_no_problem(shards: Path) -> None:
    assert verify_shards(shards) == []
    assert verify_shards(shards, workers=2) == []


def test_checksum_mismatch_is_named(shards: Path) -> None:
    shard = Manifest.load(shards).split("train").shards[1]
    path = shards / shard.path
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # inside the end-of-archive padding: the tar still reads
    path.write_bytes(bytes(data))
    problems = verify_shards(shards)
    assert [p.shard for p in problems] == [shard.path]
    assert "sha256" in problems[0].message


def test_missing_shard_is_named(shards: Path) -> None:
    shard = Manifest.load(shards).split("train").shards[0]
    (shards / shard.path).unlink()
    assert [str(p) for p in verify_shards(shards)] == [f"{shard.path}: missing file"]


def test_undecodable_image_is_named(shards: Path) -> None:
    shard = Manifest.load(shards).split("train").shards[2]
    path = shards / shard.path
    with tarfile.open(path) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".png"))
    data = bytearray(path.read_bytes())
    data[member.offset_data : member.offset_data + member.size] = b"\x00" * member.size  # same size, garbage
    path.write_bytes(bytes(data))
    messages = [p.message for p in verify_shards(shards)]
    assert any(f"image {member.name} does not decode" in m for m in messages), messages
    assert any("sha256" in m for m in messages)


def test_truncated_shard_is_named(shards: Path) -> None:
    shard = Manifest.load(shards).split("train").shards[0]
    path = shards / shard.path
    path.write_bytes(path.read_bytes()[:2048])
    messages = " ".join(p.message for p in verify_shards(shards) if p.shard == shard.path)
    assert "size 2048 bytes" in messages and "truncated" in messages


def test_info_table(shards: Path) -> None:
    lines = format_info(shards).splitlines()
    assert lines[0].split() == ["split", "category", "classes", "images", "shards", "MB"]
    assert lines[1].split()[:5] == ["train", "cat0", "3", "9", "2"]
    assert lines[2].split()[:5] == ["train", "cat1", "2", "6", "2"]
    assert lines[3].split()[:5] == ["train", "TOTAL", "5", "15", "4"]


def test_cli_build_verify_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_image_folder(tmp_path / "img", [[2, 3], [2, 2]], image_size=8)
    out = tmp_path / "s"
    assert (
        main(
            [
                "shards",
                "build",
                str(tmp_path / "img"),
                str(out),
                "--workers",
                "1",
                "--no-progress",
                "--test-fraction",
                "0.5",
            ]
        )
        == 0
    )
    assert main(["shards", "verify", str(out)]) == 0
    assert main(["shards", "info", str(out)]) == 0
    assert "TOTAL" in capsys.readouterr().out
    shard = Manifest.load(out).split("test").shards[0]
    (out / shard.path).unlink()
    assert main(["shards", "verify", str(out), "--no-decode"]) == 1
    assert f"{shard.path}: missing file" in capsys.readouterr().err
    assert main(["shards", "build", str(tmp_path / "img"), str(out), "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    shutil.rmtree(out)
    assert main(["shards", "info", str(out)]) == 2


def _pax_shard(tmp_path: Path) -> Path:
    """Two labelled samples as another tool writes them: pax headers, a name over 100 bytes."""
    write_image_folder(tmp_path / "img", [[2]], image_size=8)
    image = next((tmp_path / "img").rglob("*.png")).read_bytes()
    path = tmp_path / "pax.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for key in ("a" * 120, "b"):  # a name over 100 bytes needs a pax header
            for ext, data in (("png", image), ("cls", b"7"), ("json", b"{}")):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                info.pax_headers = {"comment": "from elsewhere"}
                tar.addfile(info, io.BytesIO(data))
    return path


def test_scan_reads_tars_from_other_writers(tmp_path: Path) -> None:
    """Shards written by another tool (pax headers, long names) are indexed through tarfile instead."""
    from ddp_rank.data.format.tar_scan import scan_shard

    scan = scan_shard(_pax_shard(tmp_path), expected=2)
    assert scan.error is None
    assert [(s.key, s.class_id) for s in scan.samples] == [("a" * 120, 7), ("b", 7)]


def test_scan_of_tars_from_other_writers_sees_where_tarfile_stops_quietly(tmp_path: Path) -> None:
    """tarfile ends its walk without an error at a corrupt header after the first, or where a file was cut
    between members: the scan names that place instead of reporting a sound shard (even with no count)."""
    from ddp_rank.data.format.tar_scan import scan_shard

    path = _pax_shard(tmp_path)
    with tarfile.open(path) as tar:
        last_header = tar.getmembers()[-1].offset
    sound = path.read_bytes()
    path.write_bytes(sound[:last_header] + b"\xff" * 20 + sound[last_header + 20 :])
    corrupt = f"corrupt tar header at byte {last_header} of {len(sound)}; the rest of the shard cannot be read"
    assert scan_shard(path).error == corrupt
    path.write_bytes(sound[:last_header])
    assert "no end-of-archive marker" in str(scan_shard(path).error)


def _foreign_tar(path: Path, keys: list[tuple[str, str]], with_cls: bool) -> None:
    """A shard as other tools write them: ``(key, label)`` samples, a json label and, if asked, a ``.cls``
    member holding the class NAME (not a ddp_rank class id)."""
    write_image_folder(path.parent / "img", [[1]], image_size=8)
    image = next((path.parent / "img").rglob("*.png")).read_bytes()
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, label in keys:
            members = [("png", image), ("json", f'{{"label": "{label}"}}'.encode())]
            if with_cls:
                members.append(("cls", label.encode()))
            for ext, data in members:
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("with_cls", [False, True])
def test_indexed_foreign_shards_verify(tmp_path: Path, with_cls: bool) -> None:
    """Indexed shards take their classes from the manifest: no .cls member (img2dataset), or one holding a
    name, is no problem."""
    _foreign_tar(tmp_path / "wds" / "x.tar", [(f"k{n}", "ab"[n // 3]) for n in range(6)], with_cls)
    assert main(["shards", "index", str(tmp_path / "wds"), "--class-field", "label"]) == 0
    assert verify_shards(tmp_path / "wds") == []


def test_keys_with_directories_are_distinct_samples(tmp_path: Path) -> None:
    """``a/0000`` and ``b/0000`` are two samples (WebDataset's key keeps the directory)."""
    keys = [(f"{label}/{k:04d}", label) for label in "abc" for k in range(3)]
    _foreign_tar(tmp_path / "wds" / "x.tar", keys, with_cls=False)
    assert main(["shards", "index", str(tmp_path / "wds"), "--class-field", "label"]) == 0
    assert verify_shards(tmp_path / "wds") == []


def test_built_shards_still_need_their_cls_member(shards: Path) -> None:
    shard = Manifest.load(shards).split("train").shards[0]
    path = shards / shard.path
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for info, data in members:
            if not info.name.endswith(".cls"):
                tar.addfile(info, io.BytesIO(data))
    messages = [p.message for p in verify_shards(shards) if p.shard == shard.path]
    assert any("incomplete sample" in m for m in messages), messages


def test_verify_reads_the_shards_where_the_manifest_says(shards: Path, tmp_path: Path) -> None:
    """A manifest kept away from its shards (``shards_root``) is verified against those shards; shards behind a
    URL are refused with the way out instead of being reported missing."""
    manifest = Manifest.load(shards)
    elsewhere = replace(manifest, shards_root=str(shards.resolve()))
    (tmp_path / "m").mkdir()
    elsewhere.save(tmp_path / "m")
    assert verify_shards(tmp_path / "m") == []
    replace(manifest, shards_root="http://127.0.0.1:1/bucket").save(tmp_path / "m")
    with pytest.raises(ValueError, match="verify reads local files"):
        verify_shards(tmp_path / "m")
