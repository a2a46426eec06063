"""Listings as other tools export them, and the class-order split, through ``ddp-rank shards build``.

A moved CSV fails with one line that states where relative paths are taken from; a ``path,label`` header is
told which column looks like the class and how to map it (``--class-column``); ``--on-bad skip`` shows what it
left out, grouped by cause, also when nothing is left; ``--test-classes last`` holds out the last classes in
name order and records it in the manifest.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.data.building.listing import Report
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest

BUILD = ["--workers", "1", "--no-progress"]


def _listing(folder: Path, header: list[str], n_classes: int = 2) -> Path:
    """``folder/list.csv`` with relative paths to ``folder/img/...``: 2 images a class."""
    paths = write_image_folder(folder / "img", [[2] * n_classes], image_size=8)
    out = folder / "list.csv"
    with out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows([str(p.relative_to(folder)), p.parent.name] for p in paths)
    return out


def _errors(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_moved_listing_fails_with_one_line_stating_the_rule(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = _listing(tmp_path / "a", ["path", "class"])
    moved = tmp_path / "b" / "list.csv"
    moved.parent.mkdir()
    shutil.move(listing, moved)
    assert main(["shards", "build", str(moved), str(tmp_path / "out"), *BUILD]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "none of its 4 relative image path(s) exists" in err
    assert "relative paths in a listing are taken from the listing's own folder" in err
    monkeypatch.chdir(tmp_path / "a")  # where the paths do resolve: said so
    assert main(["shards", "build", str(moved), str(tmp_path / "out"), *BUILD]) == 2
    assert "they exist relative to the current folder instead" in capsys.readouterr().err


def test_the_rule_is_in_the_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["shards", "build", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "relative paths in a listing are taken from the listing's own folder" in text
    assert "--class-column" in text and "--test-classes" in text


def test_label_header_names_the_lookalike_and_the_mapping(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listing = _listing(tmp_path, ["path", "label"])
    assert main(["shards", "build", str(listing), str(tmp_path / "out"), *BUILD]) == 2
    (line,) = _errors(capsys)
    assert (
        "missing column(s) ['class']" in line
        and "column 'label' looks like it: pass --class-column label" in line
    )
    assert (
        main(["shards", "build", str(listing), str(tmp_path / "out"), "--class-column", "label", *BUILD]) == 0
    )
    manifest = Manifest.load(tmp_path / "out")
    assert [c.name for c in manifest.classes] == ["cls0_0", "cls0_1"]


def test_path_column_and_bad_mappings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    listing = _listing(tmp_path, ["filepath", "class"])
    assert main(["shards", "build", str(listing), str(tmp_path / "o1"), *BUILD]) == 2
    assert "column 'filepath' looks like it: pass --path-column filepath" in _errors(capsys)[0]
    assert (
        main(["shards", "build", str(listing), str(tmp_path / "o1"), "--path-column", "filepath", *BUILD])
        == 0
    )
    capsys.readouterr()
    assert (
        main(["shards", "build", str(listing), str(tmp_path / "o2"), "--class-column", "klass", *BUILD]) == 2
    )
    assert "--class-column klass: the header has no such column" in _errors(capsys)[0]
    both = _listing(tmp_path / "both", ["path", "class"])
    assert main(["shards", "build", str(both), str(tmp_path / "o3"), "--class-column", "path", *BUILD]) == 2
    assert "the header has a 'class' column too" in _errors(capsys)[0]


def test_skip_shows_the_causes_grouped_even_when_nothing_is_left(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = write_image_folder(tmp_path / "img", [[2, 2, 2]], image_size=8)
    for p in paths:
        p.write_bytes(b"not an image")
    assert (
        main(["shards", "build", str(tmp_path / "img"), str(tmp_path / "out"), "--on-bad", "skip", *BUILD])
        == 2
    )
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "skipped 6 item(s):"
    assert err[1].startswith("  6 x unreadable image (not an image in a format read here")
    assert err[-1].startswith("error: nothing left to write") and len(err) == 3


def test_report_summary_groups_by_cause() -> None:
    report = Report()
    report.skip("unreadable image (truncated)", ["a.jpg", "b.jpg", "c.jpg"], ["a: t", "b: t", "c: t"])
    report.skipped.append("a line of its own")
    other = Report()
    other.skip("duplicate path, first row kept", ["d.jpg"])
    report.extend(other)
    assert report.summary() == [
        "3 x unreadable image (truncated): a.jpg, b.jpg, ...",
        "1 x duplicate path, first row kept: d.jpg",
        "a line of its own",
    ]
    assert len(report.skipped) == 5


def test_last_classes_in_name_order_are_the_test_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "photos"
    for i in range(1, 11):  # c1 ... c10: by name with numbers as numbers, c10 is last (as text, c10 < c2)
        write_image_folder(tmp_path / "tmp", [[2]], image_size=8, seed=i)
        shutil.move(tmp_path / "tmp" / "cat0" / "cls0_0", root / f"c{i}")
    out = tmp_path / "out"
    args = [
        "shards",
        "build",
        str(root),
        str(out),
        "--test-fraction",
        "0.5",
        "--test-classes",
        "last",
        *BUILD,
    ]
    assert main(args) == 0
    manifest = Manifest.load(out)
    test = {manifest.classes[c].name for c in manifest.split("test").class_counts}
    assert test == {f"c{i}" for i in range(6, 11)}
    assert manifest.build["test_classes"] == "last" and manifest.build["test_fraction"] == 0.5
    capsys.readouterr()
    assert main(["shards", "build", str(root), str(tmp_path / "o2"), "--test-classes", "last", *BUILD]) == 2
    (line,) = _errors(capsys)
    assert "--test-fraction, which is 0: pass e.g. --test-fraction 0.5" in line
