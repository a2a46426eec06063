"""Shard building: layout, determinism, atomicity, and the messages for bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from ddp_rank.data.building import build as build_module
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import ListingError, Record, Report, read_csv_listing, read_image_folder
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest

QUIET = {"progress": False}


def _folder(tmp_path: Path, sizes: list[list[int]] | None = None, fmt: str = "png") -> Path:
    root = tmp_path / "images"
    write_image_folder(root, sizes or [[2, 3, 4, 5, 6], [3, 3, 3], [2, 7]], image_size=8, image_format=fmt)
    return root


def _csv(path: Path, header: list[str], rows: list[list[str]]) -> Path:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def test_layout_one_category_per_shard_whole_contiguous_classes(tmp_path: Path) -> None:
    result = build_shards(
        read_image_folder(_folder(tmp_path)),
        tmp_path / "out",
        BuildOptions(max_samples=7, test_fraction=0.4, split_seed=1, **QUIET),
    )
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.categories == ("cat0", "cat1", "cat2")
    assert set(manifest.splits) == {"train", "test"}
    train_classes = set(manifest.split("train").class_counts)
    assert not train_classes & set(manifest.split("test").class_counts), "splits are by class"
    seen_classes: set[int] = set()
    for split in manifest.splits.values():
        for shard in split.shards:
            assert shard.samples <= 7 or len(shard.classes) == 1
            assert {manifest.classes[c].category for c, _ in shard.classes} == {shard.category}
            ids = [c for c, _ in shard.classes]
            assert not seen_classes & set(ids), "a class split across shards"
            seen_classes.update(ids)
            with tarfile.open(manifest.shard_path(shard)) as tar:
                names = tar.getnames()
            assert len(names) == 3 * shard.samples
            stored = [int(n.split("_")[0][1:]) for n in names[::3]]
            assert stored == sorted(stored), "classes stored contiguously"
    assert result.manifest.split("train").samples + result.manifest.split("test").samples == 20 + 9 + 9


def test_same_input_same_bytes_whatever_the_workers(tmp_path: Path) -> None:
    records = read_image_folder(_folder(tmp_path))
    build_shards(records, tmp_path / "a", BuildOptions(max_samples=6, test_fraction=0.3, workers=1, **QUIET))
    build_shards(
        records[::-1], tmp_path / "b", BuildOptions(max_samples=6, test_fraction=0.3, workers=2, **QUIET)
    )
    files_a = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*") if p.is_file())
    assert files_a == files_b and len(files_a) > 3
    for rel in files_a:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_interrupted_build_leaves_no_shard_under_its_final_name(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    records = read_image_folder(_folder(tmp_path))
    real = build_module.image_bytes
    calls = {"n": 0}

    def failing(path: str, options: BuildOptions) -> tuple[bytes, str]:
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt("simulated interruption")
        return real(path, options)

    monkeypatch.setattr(build_module, "image_bytes", failing)
    with pytest.raises(KeyboardInterrupt):
        build_shards(records, tmp_path / "out", BuildOptions(max_samples=5, **QUIET))
    out = tmp_path / "out"
    finished = sorted(p.name for p in out.rglob("*.tar"))
    assert not list(out.rglob("*.partial")), "partial file left behind"
    assert not (out / "manifest.json").exists()
    for name in finished:  # shards completed before the interruption are whole
        with tarfile.open(next(out.rglob(name))) as tar:
            assert len(tar.getnames()) % 3 == 0
    assert len(finished) == 1  # 8 images written = shard 0 (5: classes 2+3), shard 1 interrupted


def test_resize_and_reencode(tmp_path: Path) -> None:
    root = tmp_path / "big"
    write_image_folder(root, [[2, 2]], image_size=40, image_format="png")
    build_shards(
        read_image_folder(root), tmp_path / "out", BuildOptions(resize=16, image_format="jpg", **QUIET)
    )
    manifest = Manifest.load(tmp_path / "out")
    with tarfile.open(manifest.shard_path(manifest.split("train").shards[0])) as tar:
        images = [n for n in tar.getnames() if n.endswith(".jpg")]
        from PIL import Image

        member = tar.extractfile(images[0])
        assert member is not None
        assert Image.open(member).size == (16, 16)
    assert len(images) == 4


def test_csv_listing_with_splits_and_subsets(tmp_path: Path) -> None:
    paths = write_image_folder(tmp_path / "img", [[2, 2], [3]], image_size=8)
    rows = [
        [
            str(p.relative_to(tmp_path)),
            p.parent.name,
            p.parent.parent.name,
            "test" if i < 4 else "train",
            "query" if i % 2 else "gallery",
        ]
        for i, p in enumerate(paths)
    ]
    listing = _csv(tmp_path / "list.csv", ["path", "class", "category", "split", "subset"], rows)
    build_shards(read_csv_listing(listing), tmp_path / "out", BuildOptions(**QUIET))
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.split("test").samples == 4 and manifest.split("train").samples == 3


def test_folder_without_categories_and_mixed_depths(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "x", [[2, 3]], image_size=8)
    flat = tmp_path / "x" / "cat0"
    records = read_image_folder(flat)
    assert {r.category for r in records} == {None} and {r.cls for r in records} == {"cls0_0", "cls0_1"}
    (tmp_path / "x" / "stray.png").write_bytes((flat / "cls0_0" / "0000.png").read_bytes())
    with pytest.raises(ListingError, match="depths"):
        read_image_folder(tmp_path / "x")


def test_duplicate_paths(tmp_path: Path) -> None:
    paths = write_image_folder(tmp_path / "img", [[3]], image_size=8)
    rows = [[str(p), "a"] for p in paths] + [[str(paths[0]), "a"]]
    listing = _csv(tmp_path / "l.csv", ["path", "class"], rows)
    with pytest.raises(ListingError, match=r"duplicate path .*0000\.png"):
        build_shards(read_csv_listing(listing), tmp_path / "out", BuildOptions(**QUIET))
    result = build_shards(read_csv_listing(listing), tmp_path / "out2", BuildOptions(on_bad="skip", **QUIET))
    assert result.manifest.split("train").samples == 3
    assert any("duplicate" in s for s in result.report.skipped)


def test_unreadable_image_with_and_without_skip(tmp_path: Path) -> None:
    root = _folder(tmp_path, [[3, 2]])
    broken = root / "cat0" / "cls0_0" / "0001.png"
    broken.write_bytes(b"not an image at all")
    with pytest.raises(ListingError, match=r"unreadable image .*0001\.png"):
        build_shards(read_image_folder(root), tmp_path / "out", BuildOptions(**QUIET))
    assert not (tmp_path / "out" / "manifest.json").exists()
    result = build_shards(read_image_folder(root), tmp_path / "out2", BuildOptions(on_bad="skip", **QUIET))
    assert result.manifest.split("train").samples == 4
    assert any("0001.png" in s for s in result.report.skipped)


def test_class_with_one_image(tmp_path: Path) -> None:
    root = _folder(tmp_path, [[1, 3]])
    with pytest.raises(ListingError, match="class 'cls0_0' of category 'cat0' has 1 image"):
        build_shards(read_image_folder(root), tmp_path / "out", BuildOptions(**QUIET))
    skipped = build_shards(read_image_folder(root), tmp_path / "o2", BuildOptions(on_bad="skip", **QUIET))
    assert skipped.manifest.split("train").samples == 3
    kept = build_shards(read_image_folder(root), tmp_path / "o3", BuildOptions(min_class_size=1, **QUIET))
    assert kept.manifest.split("train").samples == 4


def test_unknown_and_missing_columns(tmp_path: Path) -> None:
    paths = write_image_folder(tmp_path / "img", [[2]], image_size=8)
    listing = _csv(tmp_path / "l.csv", ["path", "class", "colour"], [[str(p), "a", "red"] for p in paths])
    with pytest.raises(ListingError, match=r"(?s)unknown column 'colour'.*known columns: path, class"):
        read_csv_listing(listing)
    report = Report()
    assert len(read_csv_listing(listing, on_bad="skip", report=report)) == 2
    assert report.skipped == [f"{listing}: unknown column 'colour'"]
    bad = _csv(tmp_path / "m.csv", ["file", "class"], [["x", "a"]])
    with pytest.raises(ListingError, match=r"missing column\(s\) \['path'\]"):
        read_csv_listing(bad)


def test_same_class_name_in_two_categories_is_two_classes_and_existing_output(tmp_path: Path) -> None:
    paths = write_image_folder(tmp_path / "img", [[4]], image_size=8)
    records = [Record(str(p), "a", "x" if i < 2 else "y") for i, p in enumerate(paths)]
    manifest = build_shards(records, tmp_path / "out", BuildOptions(**QUIET)).manifest
    assert [(c.name, manifest.categories[c.category or 0]) for c in manifest.classes] == [
        ("a", "x"),
        ("a", "y"),
    ]
    assert manifest.split("train").class_counts == {0: 2, 1: 2}
    lonely = [Record(str(paths[0]), "b", "x"), Record(str(paths[1]), "b", "y")]
    with pytest.raises(ListingError, match="class 'b' of category 'x' has 1 image"):
        build_shards(lonely, tmp_path / "out1", BuildOptions(**QUIET))
    good = [Record(str(p), "a", "x") for p in paths]
    build_shards(good, tmp_path / "out2", BuildOptions(**QUIET))
    with pytest.raises(FileExistsError, match="--overwrite"):
        build_shards(good, tmp_path / "out2", BuildOptions(**QUIET))
    build_shards(good, tmp_path / "out2", BuildOptions(overwrite=True, **QUIET))


def test_image_folder_with_shared_class_names_ignored_files_and_jpeg(tmp_path: Path) -> None:
    """root/<category>/<class>/: 'red' under two categories is two classes; hidden files, AppleDouble forks and
    non-images are counted in the report; .jpeg files are images (stored as .jpg members)."""
    from PIL import Image

    root = tmp_path / "photos"
    for category in ("cars", "roses"):
        for k in range(2):
            (root / category / "red").mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (200, 10 * k, 0)).save(root / category / "red" / f"{k}.jpeg")
    (root / "cars" / "red" / "._0.jpeg").write_bytes(b"\x00\x05\x16\x07")  # a macOS resource fork
    (root / "cars" / ".DS_Store").write_bytes(b"junk")
    (root / "roses" / "red" / "notes.txt").write_text("not an image")
    report = Report()
    records = read_image_folder(root, report)
    assert len(records) == 4
    assert report.notes and "ignored 3 file(s)" in report.notes[0] and "._0.jpeg" in report.notes[0]
    manifest = build_shards(records, tmp_path / "out", BuildOptions(**QUIET)).manifest
    assert len(manifest.classes) == 2 and {c.name for c in manifest.classes} == {"red"}
    import tarfile

    with tarfile.open(manifest.shard_path(manifest.split("train").shards[0])) as tar:
        assert any(m.name.endswith(".jpg") for m in tar.getmembers())


def test_webdataset_reads_the_shards(tmp_path: Path) -> None:
    """The shards are plain WebDataset tars: the webdataset library groups their members into samples."""
    import webdataset as wds

    build_shards(read_image_folder(_folder(tmp_path)), tmp_path / "out", BuildOptions(max_samples=6, **QUIET))
    manifest = Manifest.load(tmp_path / "out")
    shard = manifest.split("train").shards[0]
    samples = list(wds.WebDataset(str(manifest.shard_path(shard)), shardshuffle=False, nodesplitter=None))
    assert len(samples) == shard.samples
    assert {k for k in samples[0] if not k.startswith("__")} == {"png", "cls", "json"}
    assert [int(s["cls"]) for s in samples] == [c for c, n in shard.classes for _ in range(n)]


def test_overwrite_refuses_an_output_that_holds_the_source_images(tmp_path: Path) -> None:
    """`shards build photos . --overwrite` (OUT the image folder's parent, or the folder itself) must not delete
    a single image: it is refused before anything is touched."""
    root = _folder(tmp_path, [[3, 3]])
    (tmp_path / "notes.txt").write_text("mine")
    before = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    for out in (tmp_path, root, root / "cat0"):
        with pytest.raises(ListingError, match=r"holds source images .*outside the image folders"):
            build_shards(read_image_folder(root), out, BuildOptions(overwrite=True, **QUIET))
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == before


def test_overwrite_refuses_a_directory_that_is_not_a_shard_directory(tmp_path: Path) -> None:
    records = read_image_folder(_folder(tmp_path, [[2, 2]]))
    out = tmp_path / "out"
    (out / "papers").mkdir(parents=True)
    (out / "papers" / "fastap.pdf").write_bytes(b"%PDF")
    (out / "todo.txt").write_text("x")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match=r"not a shard directory .*papers/fastap\.pdf, todo\.txt"):
            build_shards(records, out, BuildOptions(overwrite=overwrite, **QUIET))
    assert (out / "papers" / "fastap.pdf").read_bytes() == b"%PDF" and (out / "todo.txt").exists()


def test_overwrite_replaces_only_what_a_build_wrote(tmp_path: Path) -> None:
    records = read_image_folder(_folder(tmp_path))
    out = tmp_path / "out"
    build_shards(records, out, BuildOptions(max_samples=4, test_fraction=0.4, **QUIET))
    old = {p.relative_to(out) for p in out.rglob("*.tar")}
    assert any(p.parts[0] == "test" for p in old) and len(old) > 4
    (out / "README.txt").write_text("kept")
    (out / "train" / "keep.txt").write_text("kept")
    (out / "extra").mkdir()
    (out / "extra" / "data.bin").write_bytes(b"kept")
    build_shards(records, out, BuildOptions(max_samples=1000, overwrite=True, **QUIET))
    manifest = Manifest.load(out)
    assert set(manifest.splits) == {"train"}
    new = {p.relative_to(out) for p in out.rglob("*.tar")}
    assert new == {Path(s.path) for s in manifest.split("train").shards}, "old shards left behind"
    assert not (out / "test").exists(), "the emptied split folder is removed"
    for kept in ("README.txt", "train/keep.txt", "extra/data.bin"):
        assert (out / kept).exists(), kept


def test_bad_input_keeps_an_earlier_build_and_an_unfinished_one_is_replaced(tmp_path: Path) -> None:
    root = _folder(tmp_path, [[3, 2]])
    out = tmp_path / "out"
    build_shards(read_image_folder(root), out, BuildOptions(**QUIET))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (root / "cat0" / "cls0_0" / "0001.png").write_bytes(b"not an image")
    with pytest.raises(ListingError, match="unreadable image"):
        build_shards(read_image_folder(root), out, BuildOptions(overwrite=True, **QUIET))
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    (out / "manifest.json").unlink()  # what an interrupted build leaves: shards, no manifest
    (out / "train" / ".train-c0000-00001.tar.partial").write_bytes(b"half")
    with pytest.raises(FileExistsError, match=r"unfinished build.*--overwrite"):
        build_shards(read_image_folder(root), out, BuildOptions(on_bad="skip", **QUIET))
    build_shards(read_image_folder(root), out, BuildOptions(on_bad="skip", overwrite=True, **QUIET))
    assert Manifest.load(out).split("train").samples == 4
    assert not list(out.rglob("*.partial"))


def test_csv_listing_with_a_byte_order_mark(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts the file with a BOM; the header is still read as path,class."""
    paths = write_image_folder(tmp_path / "img", [[2]], image_size=8)
    listing = tmp_path / "excel.csv"
    listing.write_text("path,class\n" + "".join(f"{p},a\n" for p in paths), encoding="utf-8-sig")
    assert listing.read_bytes().startswith(b"\xef\xbb\xbf")
    assert [r.cls for r in read_csv_listing(listing)] == ["a", "a"]


@pytest.mark.slow
def test_ids_of_names_that_tie_as_numbers_do_not_depend_on_the_hash_seed() -> None:
    """Names "7", "07" and "007" are equal as numbers; their ids (and the held-out classes) must not follow the
    iteration order of a set, which changes with PYTHONHASHSEED."""
    script = (
        "import json\n"
        "from ddp_rank.data.building.build import _number\n"
        "from ddp_rank.data.building.listing import Record, assign_splits\n"
        "recs = [Record(f'/x/{g}/{c}/{i}.png', c, g) for g in ('1', '01') for c in ('7', '07', '007', '8')"
        " for i in range(2)]\n"
        "cats, classes, _ = _number(recs)\n"
        "test = sorted({(r.category, r.cls) for r in assign_splits(recs, 0.5, 0) if r.split == 'test'})\n"
        "print(json.dumps([cats, [(c.name, c.category) for c in classes], test]))\n"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(6)
    }
    assert len(outputs) == 1, outputs
    categories, classes, _ = json.loads(outputs.pop())
    assert categories == ["01", "1"]
    assert [name for name, _ in classes] == ["007", "07", "7", "8"] * 2


def test_the_pixel_limit_is_the_users(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ddp_rank.cli import main
    from ddp_rank.data.reading.decode import ImageDecodeError

    root = _folder(tmp_path, [[2, 2]])  # 8 x 8 = 64 pixels each
    args = ["shards", "build", str(root), "--no-progress", "--workers", "1"]
    assert main([*args[:3], str(tmp_path / "ok"), *args[3:], "--max-image-pixels", "64"]) == 0
    capsys.readouterr()
    assert main([*args[:3], str(tmp_path / "small"), *args[3:], "--max-image-pixels", "63"]) == 2
    err = capsys.readouterr().err
    assert "4 unreadable image(s)" in err and "64 pixels is over the limit of 63" in err
    # The bytes are read under the same limit (a resize re-opens each image).
    path = str(next(root.rglob("*.png")))
    with pytest.raises(ImageDecodeError, match="over the limit of 10"):
        build_module.image_bytes(path, BuildOptions(resize=4, max_image_pixels=10, **QUIET))
    assert build_module.image_bytes(path, BuildOptions(resize=4, max_image_pixels=64, **QUIET))[1] == "png"
    # In worker processes too (the list is checked in parallel above 256 images).
    assert build_module.check_image(path, 63) is not None and build_module.check_image(path, 64) is None


@pytest.mark.parametrize("split", ["..", "a/b"])
def test_a_split_that_is_not_one_folder_is_refused(tmp_path: Path, split: str) -> None:
    paths = write_image_folder(tmp_path / "img", [[2]], image_size=8)
    rows = [[str(p.relative_to(tmp_path)), "c", split] for p in paths]
    listing = _csv(tmp_path / "list.csv", ["path", "class", "split"], rows)
    with pytest.raises(ListingError, match=f"split name {split!r} is not allowed.*split column"):
        build_shards(read_csv_listing(listing), tmp_path / "deep" / "out", BuildOptions(**QUIET))
    assert not list(tmp_path.rglob("*.tar"))
