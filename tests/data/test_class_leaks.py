"""No split that leaks classes: a class of the train split in another split (held-out classes seen in
training) is refused by
``shards build`` / ``index`` / ``reshard`` with one line naming the file and the fix, reported by ``shards
verify``, and accepted only when the manifest records why (``--shared-classes REASON``)."""

from __future__ import annotations

import csv
import io
import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.data.format.class_leaks import class_leak, manifest_leak
from ddp_rank.data.format.manifest import Manifest, ManifestError

REASON = "closed-set identification"


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (seed * 40 % 256, 60, 90)).save(buf, format="PNG")
    return buf.getvalue()


def _listing(tmp_path: Path, rows: list[tuple[str, str, str]]) -> Path:
    """A CSV listing of (class, category, split) rows, two images each, written under ``tmp_path``."""
    path = tmp_path / "listing.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["path", "class", "category", "split"])
        for n, (cls, category, split) in enumerate(rows):
            for k in range(2):
                image = tmp_path / "images" / f"{n}_{k}.png"
                image.parent.mkdir(parents=True, exist_ok=True)
                image.write_bytes(_png(n))
                writer.writerow([str(image), cls, category, split])
    return path


LEAKY = [("a", "birds", "train"), ("b", "birds", "train"), ("a", "birds", "test"), ("c", "birds", "test")]
"""Class ``birds/a`` has images in both splits: the image-level split of a classification set."""


def _build(tmp_path: Path, rows: list[tuple[str, str, str]], *extra: str) -> tuple[int, Path]:
    out = tmp_path / "shards"
    code = main(
        [
            "shards",
            "build",
            str(_listing(tmp_path, rows)),
            str(out),
            "--workers",
            "1",
            "--no-progress",
            *extra,
        ]
    )
    return code, out


def test_build_refuses_a_listing_whose_test_classes_are_in_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _build(tmp_path, LEAKY)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        f"error: {tmp_path / 'listing.csv'}: 1 class of split 'train' is also in split 'test' (1), e.g. 'birds/a'"
    )
    assert "--test-fraction" in err and "--shared-classes REASON" in err
    assert not (out / "manifest.json").exists()


def test_build_with_the_option_records_the_protocol_and_verify_accepts_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _build(tmp_path, LEAKY, "--shared-classes", REASON)
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert (
        f"shared classes: {REASON} (recorded with --shared-classes" in printed.out
    )  # the info table's last line
    assert json.loads((out / "manifest.json").read_text())["shared_classes"] == REASON
    manifest = Manifest.load(out)
    assert manifest.shared_classes == REASON and "shared_classes" not in manifest.build
    assert manifest_leak(manifest) is None
    assert main(["shards", "verify", str(out), "--no-decode", "--workers", "1"]) == 0


def test_a_blank_reason_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = _build(tmp_path, LEAKY, "--shared-classes", " ")
    assert code == 2
    assert "--shared-classes needs a reason" in capsys.readouterr().err


def test_a_class_is_its_category_and_name(tmp_path: Path) -> None:
    """The same class name under two categories is two classes: one in each split is no leak."""
    code, out = _build(tmp_path, [("a", "birds", "train"), ("b", "birds", "train"), ("a", "cars", "test")])
    assert code == 0
    manifest = Manifest.load(out)
    assert manifest.shared_classes is None and manifest_leak(manifest) is None


def test_subsets_of_one_split_share_classes_freely() -> None:
    """In-Shop's query and gallery are subsets of its test split: only splits are compared, and with a split
    named, only the pairs that hold it (a run's training split against the rest)."""
    assert class_leak({"train": {1, 2}, "test": {3, 4}}, str) is None
    assert class_leak({"train": {1}, "test_small": {3}, "test_large": {3, 4}}, str) is None  # VehicleID
    problem = class_leak({"train": {1, 2, 5, 6}, "val": {2}, "test": {1, 2, 5, 6, 9}}, str)
    assert (
        problem
        == "4 classes of split 'train' are also in split 'test' (4) and split 'val' (1), e.g. '1', '2', '5', ..."
    )
    assert class_leak({"base": {1}, "novel": {1}}, str) is None  # no train split: nothing was trained on
    assert class_leak({"base": {1}, "novel": {1}}, str, train="base") == (
        "1 class of split 'base' is also in split 'novel' (1), e.g. '1'"
    )


def test_verify_reports_a_leak_in_a_manifest_without_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A manifest written before the record existed (no ``shared_classes``) still loads; verify names the leak."""
    _, out = _build(tmp_path, LEAKY, "--shared-classes", REASON)
    _drop_record(out)
    assert Manifest.load(out).shared_classes is None
    capsys.readouterr()
    assert main(["shards", "verify", str(out), "--no-decode", "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "manifest.json: splits: 1 class of split 'train' is also in split 'test' (1)" in err
    assert "--shared-classes REASON" in err and "FAILED: 1 problem(s)" in err
    # the fix the line gives for shards that exist: re-index them in place, names kept, the protocol recorded
    assert main(["shards", "index", str(out), "--class-field", "class", "--shared-classes", REASON]) == 0
    manifest = Manifest.load(out)
    assert manifest.shared_classes == REASON and [c.name for c in manifest.classes] == ["a", "b", "c"]
    assert main(["shards", "verify", str(out), "--no-decode", "--workers", "1"]) == 0


def _drop_record(shards: Path) -> None:
    """The manifest as an earlier version wrote it: no ``shared_classes``."""
    data = json.loads((shards / "manifest.json").read_text())
    del data["shared_classes"]
    (shards / "manifest.json").write_text(json.dumps(data))


@pytest.mark.parametrize("value", ["", "  ", 3])
def test_the_manifest_field_is_checked(tmp_path: Path, value: object) -> None:
    _, out = _build(tmp_path, LEAKY, "--shared-classes", REASON)
    data = json.loads((out / "manifest.json").read_text())
    data["shared_classes"] = value
    with pytest.raises(ManifestError, match=r"manifest\.json: shared_classes: ") as caught:
        Manifest.from_json(data, out)
    assert "\n" not in str(caught.value)


def _foreign(root: Path, splits: dict[str, list[str]]) -> Path:
    """Tars as another tool writes them, ``root/<split>/part-0.tar``: per class two samples of ``.png`` and
    ``.cls`` (the class as the tool numbers it)."""
    for split, classes in splits.items():
        (root / split).mkdir(parents=True, exist_ok=True)
        with tarfile.open(root / split / "part-0.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for n, cls in enumerate(c for c in classes for _ in range(2)):
                for ext, data in (("png", _png(n)), ("cls", cls.encode())):
                    info = tarfile.TarInfo(f"s{n:04d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return root


def test_index_decides_from_the_class_field_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    leaky = _foreign(tmp_path / "leaky", {"train": ["0", "1", "2"], "val": ["2", "3"]})
    assert main(["shards", "index", str(leaky)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(
        f"error: the shards of {leaky}: 1 class of split 'train' is also in split 'val' (1), e.g. '2'"
    )
    assert "--shared-classes REASON" in err and not (leaky / "manifest.json").exists()

    assert main(["shards", "index", str(leaky), "--shared-classes", REASON]) == 0
    assert Manifest.load(leaky).shared_classes == REASON
    # A set indexed earlier without the reason: --upgrade records it in place, every other field kept.
    before = Manifest.load(leaky)
    raw = json.loads((leaky / "manifest.json").read_text(encoding="utf-8"))
    del raw["shared_classes"]
    (leaky / "manifest.json").write_text(json.dumps(raw), encoding="utf-8")
    assert Manifest.load(leaky).shared_classes is None
    assert main(["shards", "index", str(leaky), "--upgrade", "--shared-classes", "closed-set"]) == 0
    after = Manifest.load(leaky)
    assert after.shared_classes == "closed-set"
    assert (after.classes, after.splits, after.build) == (before.classes, before.splits, before.build)

    apart = _foreign(tmp_path / "apart", {"train": ["0", "1"], "val": ["2", "3"]})
    assert main(["shards", "index", str(apart)]) == 0
    assert "shared_classes" not in json.loads((apart / "manifest.json").read_text())


def test_reshard_refuses_a_leaking_source_and_keeps_the_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _foreign(tmp_path / "src", {"train": ["0", "1"], "test": ["1", "2"]})
    # without a manifest: indexed first, refused there, naming the source
    assert main(["shards", "reshard", str(source), str(tmp_path / "a"), "--no-progress"]) == 2
    assert f"error: the shards of {source}: 1 class of split 'train' is also in" in capsys.readouterr().err
    # a manifest that records the protocol: carried into the output
    assert main(["shards", "index", str(source), "--shared-classes", REASON]) == 0
    assert main(["shards", "reshard", str(source), str(tmp_path / "b"), "--no-progress"]) == 0
    assert Manifest.load(tmp_path / "b").shared_classes == REASON
    # a manifest without the record (an earlier version's): refused, then accepted with the option
    _drop_record(source)
    capsys.readouterr()
    assert main(["shards", "reshard", str(source), str(tmp_path / "c"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(
        f"error: {source / 'manifest.json'}: 1 class of split 'train'"
    )
    assert not (tmp_path / "c").exists()
    assert (
        main(
            ["shards", "reshard", str(source), str(tmp_path / "c"), "--no-progress", "--shared-classes", "x"]
        )
        == 0
    )
    assert Manifest.load(tmp_path / "c").shared_classes == "x"
