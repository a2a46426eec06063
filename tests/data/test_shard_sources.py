"""Shards as webdataset users bring them (issue 38): compressed tars (``.tar.gz`` and kin, told by their bytes)
refused by ``shards index`` with the compression and the exact command that converts them, and converted by
``shards reshard`` into the same plain tars as the uncompressed shards give; brace patterns (and globs, one tar)
as the source of ``index`` and ``reshard``, a missing shard named; the class in a ``.txt`` (or any text) member."""

from __future__ import annotations

import gzip
import io
import shlex
import tarfile
from pathlib import Path
from typing import Any

import pytest

from ddp_rank.cli import main
from ddp_rank.data.building.reshard import ReshardError, ReshardOptions, reshard
from ddp_rank.data.building.shard_index import (
    IndexOptions,
    ShardIndexError,
    index_shards,
    source_splits,
    split_source,
)
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.compressed import compression_of, plain_name
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.serve import serve_directory
from tests.helpers.foreign_shards import foreign_samples, ordered, write_with_shardwriter

SAMPLES = ordered(foreign_samples(classes_per_category=3, categories=2), "shuffled")
SMALL = ReshardOptions(max_samples=20, progress=False)


def _tars(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.tar"))}


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture(scope="module")
def plain_resharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uncompressed shards, indexed and resharded: what every conversion below must equal."""
    root = tmp_path_factory.mktemp("plain") / "wds"
    write_with_shardwriter(root, SAMPLES, "cls", maxcount=10)
    index_shards(root, source_splits(root, [])[1], IndexOptions(category_field="family")).manifest.save(root)
    out = root.parent / "resharded"
    reshard(root, out, SMALL)
    return out


@pytest.mark.parametrize(
    ("name", "compression"),
    [
        ("part-%05d.tar.gz", "gzip"),
        ("part-%05d.tgz", "gzip"),
        ("part-%05d.tar.bz2", "bzip2"),
        ("part-%05d.tar.xz", "xz"),
    ],
)
def test_compressed_shards_are_refused_by_index_with_the_command_that_converts_them(
    tmp_path: Path, name: str, compression: str, plain_resharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10, name=name)
    assert compression_of((src / (name % 0)).read_bytes()[:16]) == compression
    # The directory listed: the compression named, not "no .tar shard found".
    assert main(["shards", "index", str(src), "--category-field", "family"]) == 2
    err = _one_error_line(capsys)
    assert f"{compression}-compressed tar shards ({name % 0}" in err and "cannot be read by byte range" in err
    command = err.split("`")[1]
    assert command == f"ddp-rank shards reshard {src} {src}-plain --category-field family"
    # The shards named by a pattern: the shard named, not "unreadable tar, cut short or corrupt".
    suffix = name.split("%05d")[1]
    assert (
        main(["shards", "index", str(src), "--split", f"train=*{suffix}", "--category-field", "family"]) == 2
    )
    err = _one_error_line(capsys)
    assert f"{name % 0} is a {compression}-compressed tar" in err and "corrupt" not in err
    # The command it gives converts them: the same plain tars as the uncompressed shards reshard to.
    command = err.split("`")[1]
    assert shlex.split(command)[:5] == ["ddp-rank", "shards", "reshard", str(src), f"{src}-plain"]
    assert main([*shlex.split(command)[1:], "--no-progress", "--max-samples", "20"]) == 0
    out = Path(f"{src}-plain")
    assert _tars(out) == _tars(plain_resharded)
    assert Manifest.load(out).classes == Manifest.load(plain_resharded).classes
    assert verify_shards(out) == [] and not (out / ".reshard").exists()


def test_a_gzip_file_named_tar_is_named_as_gzip_wherever_it_is_read(
    tmp_path: Path, plain_resharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = tmp_path / "plain"
    write_with_shardwriter(plain, SAMPLES, "cls", maxcount=10)
    src = tmp_path / "disguised"
    src.mkdir()
    for tar in plain.glob("*.tar"):
        (src / tar.name).write_bytes(gzip.compress(tar.read_bytes()))
    assert main(["shards", "index", str(src), "--category-field", "family"]) == 2
    assert "part-00000.tar is a gzip-compressed tar" in _one_error_line(capsys)
    reshard(src, tmp_path / "out", SMALL, index=IndexOptions(category_field="family"))
    assert _tars(tmp_path / "out") == _tars(plain_resharded)
    # A manifest whose shard was replaced by a gzip copy: verify names the compression.
    manifest = Manifest.load(tmp_path / "out")
    shard = tmp_path / "out" / manifest.split("train").shards[0].path
    shard.write_bytes(gzip.compress(shard.read_bytes()))
    problems = [str(p) for p in verify_shards(tmp_path / "out", workers=1)]
    assert any("a gzip-compressed tar where a plain one belongs" in p for p in problems), problems
    # Training (and info, verify) pointed at compressed shards without a manifest: the same conversion named.
    with pytest.raises(
        FileNotFoundError, match=r"part-00000.tar is a gzip-compressed tar, .* `ddp-rank shards "
    ):
        Manifest.load(src)
    (src / "part-00000.tar").rename(src / "part-00000.tar.gz")
    with pytest.raises(
        FileNotFoundError, match=r"gzip-compressed tar shards \(part-00000.tar.gz\).*`ddp-rank s"
    ):
        Manifest.load(src)


def test_a_damaged_or_unreadable_compressed_shard_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10, name="part-%05d.tar.gz")
    data = (src / "part-00001.tar.gz").read_bytes()
    (src / "part-00001.tar.gz").write_bytes(data[: len(data) // 2])
    assert main(["shards", "reshard", str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    err = _one_error_line(capsys)
    assert "part-00001.tar.gz: the gzip stream does not decompress" in err and "cut short" in err
    # zstd (webdataset reads it on Python 3.14) is named; without a library for it, the way out is named.
    zst = tmp_path / "zst"
    zst.mkdir()
    (zst / "part-00000.tar.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(60))
    assert main(["shards", "index", str(zst)]) == 2
    assert "zstd-compressed tar shards (part-00000.tar.zst)" in _one_error_line(capsys)
    try:
        import zstandard  # noqa: F401
    except ImportError:
        assert main(["shards", "reshard", str(zst), str(tmp_path / "zout"), "--no-progress"]) == 2
        assert "pip install zstandard, or decompress the shards with `zstd -d`" in _one_error_line(capsys)


def test_a_killed_conversion_resumes_and_a_changed_source_is_refused(
    tmp_path: Path, plain_resharded: Path
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10, name="part-%05d.tar.gz")
    options = IndexOptions(category_field="family")
    out = tmp_path / "out"

    class Killed(Exception):
        pass

    with pytest.MonkeyPatch.context() as patch:  # killed after decompressing two of the four shards
        import ddp_rank.data.building.reshard_source as reshard_source

        calls: list[str] = []
        write_plain = reshard_source._write_plain

        def dies(location: str, target: Path) -> None:
            if len(calls) == 2:
                raise Killed
            calls.append(location)
            write_plain(location, target)

        patch.setattr(reshard_source, "_write_plain", dies)
        with pytest.raises(Killed):
            reshard(src, out, SMALL, index=options)
    work = out / ".reshard" / "source"
    assert sorted(p.name for p in work.glob("*.tar")) == ["part-00000.tar", "part-00001.tar"]
    # Another index option (or a source whose shards changed) is not mixed with the run under way.
    with pytest.raises(ReshardError, match="its shards, their index options or its manifest changed"):
        reshard(src, out, SMALL, index=IndexOptions(category_field=None))
    reshard(src, out, SMALL, index=options)
    assert _tars(out) == _tars(plain_resharded)


def test_a_brace_pattern_glob_or_tar_file_is_a_source(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10)
    assert sorted(p.name for p in src.glob("*.tar")) == [f"part-0000{i}.tar" for i in range(4)]
    assert split_source(f"{src}/part-{{00000..00003}}.tar") == (str(src), "part-{00000..00003}.tar")
    assert split_source("https://host/d/train-{0..9}.tar") == ("https://host/d", "train-{0..9}.tar")
    assert split_source(src) == (str(src), None)
    assert main(["shards", "index", f"{src}/part-{{00001..00002}}.tar", "--category-field", "family"]) == 0
    manifest = Manifest.load(src)
    assert [s.path for s in manifest.split("train").shards] == ["part-00001.tar", "part-00002.tar"]
    capsys.readouterr()
    for source, shards in ((f"{src}/*.tar", 4), (f"{src}/part-00003.tar", 1)):
        assert main(["shards", "index", source, "--out", str(tmp_path / "m")]) == 0
        assert len(Manifest.load(tmp_path / "m").split("train").shards) == shards
    # A pattern that names a missing shard: one line naming the first missing file, nothing indexed quietly.
    for args in (
        [f"{src}/part-{{00000..00009}}.tar"],
        [str(src), "--split", "train=part-{00002..00005}.tar"],
    ):
        capsys.readouterr()
        assert main(["shards", "index", *args, "--out", str(tmp_path / "none")]) == 2
        assert f"{src / 'part-00004.tar'}: no such file, the first missing one" in _one_error_line(capsys)
    assert not (tmp_path / "none").exists()
    assert main(["shards", "index", f"{src}/part-{{0..1}}.tar", "--split", "train=x.tar"]) == 2
    assert "names its shards itself: drop --split" in _one_error_line(capsys)
    (tmp_path / "outside.tar").write_bytes((src / "part-00000.tar").read_bytes())
    for outside in ("../outside.tar", "../out*.tar"):
        with pytest.raises(ShardIndexError, match=r"outside\.tar lies outside"):
            source_splits(src, [f"train={outside}"])
    # verify and info read a manifest: a pattern is told to index first.
    assert main(["shards", "verify", f"{src}/part-{{00000..00001}}.tar"]) == 2
    assert "names shards, not a shard directory; index them first with `ddp-rank shards index" in (
        _one_error_line(capsys)
    )


def test_a_brace_pattern_at_a_url_and_reshard_of_a_pattern(
    tmp_path: Path, plain_resharded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10)
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10, name="part-%05d.tar.gz")
    with serve_directory(src) as url:
        pattern = f"{url}/part-{{00000..00003}}.tar"
        out = tmp_path / "manifest"
        assert main(["shards", "index", pattern, "--category-field", "family", "--out", str(out)]) == 0
        assert Manifest.load(out).shards_root == url and Manifest.load(out).split("train").samples == len(
            SAMPLES
        )
        capsys.readouterr()
        assert (
            main(["shards", "index", f"{url}/part-{{00002..00004}}.tar", "--out", str(tmp_path / "x")]) == 2
        )
        assert f"{url}/part-00004.tar: no such shard at the URL" in _one_error_line(capsys)
        # reshard takes the same pattern (with the index options), at a URL or on disk, compressed or not.
        reshard(pattern, tmp_path / "from-url", SMALL, index=IndexOptions(category_field="family"))
        gz = f"{url}/part-{{00000..00003}}.tar.gz"
        reshard(gz, tmp_path / "from-url-gz", SMALL, index=IndexOptions(category_field="family"))
    assert _tars(tmp_path / "from-url") == _tars(plain_resharded) == _tars(tmp_path / "from-url-gz")
    code = main(
        [
            "shards", "reshard", f"{src}/part-{{00000..00003}}.tar", str(tmp_path / "from-disk"),
            "--category-field", "family", "--max-samples", "20", "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0 and _tars(tmp_path / "from-disk") == _tars(plain_resharded)
    # A source with a manifest keeps its classes: the index options are refused, not ignored.
    capsys.readouterr()
    assert main(["shards", "reshard", str(plain_resharded), str(tmp_path / "y"), "--class-field", "txt"]) == 2
    assert "holds manifest.json, whose classes the reshard keeps" in _one_error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main(["shards", "reshard", str(tmp_path / "empty"), str(tmp_path / "z"), "--no-progress"]) == 2
    assert "empty holds no manifest.json, and no .tar (or compressed tar) shard found" in _one_error_line(
        capsys
    )
    assert not (tmp_path / "z").exists()


def test_the_class_in_a_txt_member(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """webdataset users write the class as ``.txt`` (or ``.cls``, or under any text extension): --class-field
    names the member; by default a .txt is not taken (img2dataset writes captions there), and the refusal
    says how to take it."""
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "txt", maxcount=10)
    assert main(["shards", "index", str(src)]) == 2
    err = _one_error_line(capsys)
    assert "has no .cls member and no json 'class' field" in err and "--class-field txt reads the .txt" in err
    assert main(["shards", "index", str(src), "--class-field", "txt", "--category-field", "family"]) == 0
    manifest = Manifest.load(src)
    counts = {manifest.classes[c].name: n for c, n in manifest.split("train").class_counts.items()}
    expected: dict[str, int] = {}
    for s in SAMPLES:
        expected[s.cls] = expected.get(s.cls, 0) + 1
    assert counts == expected
    assert {manifest.categories[c.category] for c in manifest.classes if c.category is not None} == {
        "k0",
        "k1",
    }
    # The category from a text member too, and the member wins over a json field of the same name.
    tar = src / "part-00000.tar"
    with tarfile.open(tar) as t:
        members = [(m, t.extractfile(m).read()) for m in t.getmembers()]  # type: ignore[union-attr]
    rewritten = tmp_path / "cat" / "part-00000.tar"
    rewritten.parent.mkdir()
    with tarfile.open(rewritten, "w") as t:
        for m, data in members:
            t.addfile(m, io.BytesIO(data))
            if m.name.endswith(".txt"):
                extra = tarfile.TarInfo(m.name.replace(".txt", ".family"))
                extra.size = 4
                t.addfile(extra, io.BytesIO(b"fam\n"))
    options = IndexOptions(class_field="txt", category_field="family")
    cats = index_shards(rewritten.parent, {"train": ["part-00000.tar"]}, options).manifest.categories
    assert cats == ("fam",)
    with pytest.raises(
        ShardIndexError, match="--class-field jpg: name a json field or the extension of a text"
    ):
        IndexOptions(class_field="jpg")


def test_plain_name() -> None:
    assert plain_name("a/x.tar.gz") == "a/x.tar" and plain_name("x.TGZ") == "x.tar"
    assert plain_name("x.tar.xz") == "x.tar" and plain_name("x.tar") == "x.tar"


@pytest.mark.parametrize("name", ["..", ".", "a/b", "../up", "-x", "a b"])
def test_a_split_name_that_is_not_one_folder_is_refused_in_one_line(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "wds"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=10)
    dst = tmp_path / "deep" / "out"
    code = main(
        ["shards", "reshard", str(src), str(dst), f"--split={name}=part-*.tar", "--no-progress",
         "--category-field", "family"]
    )  # fmt: skip
    err = _one_error_line(capsys)
    assert code == 2 and f"split name {name!r} is not allowed: use letters, digits, '_', '.' and '-'" in err
    assert not list(tmp_path.rglob("*.tar")) or all(p.is_relative_to(src) for p in tmp_path.rglob("*.tar"))
    with pytest.raises(ShardIndexError, match="is not allowed"):
        source_splits(src, [f"{name}=part-*.tar"])


@pytest.mark.parametrize(
    ("expr", "problem"),
    [("../../../escaped-{0..0}.tar.gz", "'..' segment"), ("/abs/x-{0..1}.tar", "is absolute"),
     ("ok-{0..1}/../../x.tar", "'..' segment")],
)  # fmt: skip
def test_a_pattern_at_a_url_cannot_name_shards_outside_it(tmp_path: Path, expr: str, problem: str) -> None:
    import fsspec

    memory = fsspec.filesystem("memory")
    data = gzip.compress(_tars_of_samples(tmp_path))
    memory.pipe("/escaped-0.tar.gz", data)  # where the name leads, so the old code found (and wrote) it
    memory.pipe("/d/e/f/x-0.tar.gz", data)
    out = tmp_path / "a" / "b" / "c" / "out"
    with pytest.raises(ShardIndexError, match=f"the shard name .* {problem}; name shards under memory://"):
        reshard(
            "memory://d/e/f",
            out,
            SMALL,
            index=IndexOptions(category_field="family"),
            splits=(f"train={expr}",),
        )
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("*.tar"))
    assert not list(tmp_path.rglob("escaped-0.tar"))


def _tars_of_samples(tmp_path: Path) -> bytes:
    src = tmp_path / "one"
    write_with_shardwriter(src, SAMPLES, "cls", maxcount=1000)
    (tar,) = sorted(src.glob("*.tar"))
    return tar.read_bytes()


def test_the_pixel_limit_of_the_reshards_decode_is_the_users(
    plain_resharded: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["shards", "reshard", str(plain_resharded), "--decode", "--no-progress", "--max-samples", "20"]
    assert main([*args[:3], str(tmp_path / "ok"), *args[3:], "--max-image-pixels", "100000"]) == 0
    capsys.readouterr()
    assert main([*args[:3], str(tmp_path / "small"), *args[3:], "--max-image-pixels", "4"]) == 2
    err = _one_error_line(capsys)
    assert "do not verify" in err and "over the limit of 4" in err


def test_a_damaged_zstd_stream_is_one_decompress_error_whatever_the_library_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """zstandard (and Python 3.14's compression.zstd) raise their own ZstdError, not an OSError: a damaged
    .tar.zst must still end in the one-line DecompressError naming the shard, not a traceback. The library is a
    stand-in (neither is installed here) that raises as zstandard does on a corrupt frame."""
    import importlib
    import types

    from ddp_rank.data.format import compressed

    class ZstdError(Exception):
        pass

    class Reader(io.RawIOBase):
        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            raise ZstdError("zstd decompress error: Corrupted block detected")

    fake = types.ModuleType("zstandard")
    fake.ZstdError = ZstdError  # type: ignore[attr-defined]
    fake.ZstdDecompressor = lambda: types.SimpleNamespace(stream_reader=lambda src: Reader())  # type: ignore[attr-defined]
    real_import = importlib.import_module

    def import_module(name: str, *args: Any) -> Any:
        if name == "compression.zstd":
            raise ImportError(name)
        return fake if name == "zstandard" else real_import(name, *args)

    monkeypatch.setattr(compressed.importlib, "import_module", import_module)
    with pytest.raises(compressed.DecompressError, match=r"part-00000.tar.zst: the zstd stream does not decompress"):
        compressed.decompress(io.BytesIO(b"\x28\xb5\x2f\xfd" + bytes(60)), io.BytesIO(), "zstd", "part-00000.tar.zst")
