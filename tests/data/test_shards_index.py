"""`ddp-rank shards index`: shards written by other tools (webdataset's ShardWriter here) become trainable
without being rewritten; non-contiguous classes are refused with the way out; v1 manifests are upgraded."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.data.building.shard_index import (
    IndexOptions,
    ShardIndexError,
    find_splits,
    index_shards,
    read_category_map,
    upgrade_manifest,
)
from ddp_rank.data.building.verify import verify_shards
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.stream import ShardStream
from ddp_rank.data.reading.transforms import TransformConfig
from ddp_rank.data.sampling.schedule import ScheduleConfig

TINY = TransformConfig(resize=8, crop=6)


def _image(seed: int, fmt: str) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, size=(8, 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def write_foreign(
    root: Path, order: list[tuple[str, str]], per_class: int = 3, maxcount: int = 12, prefix: str = "sample"
) -> None:
    """img2dataset-like shards: ``<key>.jpg|jpeg|png`` + ``.json`` (label, family) + ``.txt`` for some."""
    root.mkdir(parents=True, exist_ok=True)
    exts = ["jpg", "jpeg", "png"]
    with wds.ShardWriter(str(root / "part-%05d.tar"), maxcount=maxcount, verbose=0) as sink:
        n = 0
        for label, family in order:
            for j in range(per_class):
                ext = exts[n % 3]
                sample = {
                    "__key__": f"{prefix}{n:06d}",
                    ext: _image(n, "PNG" if ext == "png" else "JPEG"),
                    "json": json.dumps({"label": label, "family": family, "caption": "x" * (n % 7)}),
                }
                if j % 2 == 0:
                    sample["txt"] = "a caption"
                sink.write(sample)
                n += 1


def test_foreign_shards_are_indexed_and_stream(tmp_path: Path) -> None:
    order = [(f"species{i}", f"family{i % 3}") for i in range(12)]
    write_foreign(tmp_path / "wds", order)
    report = index_shards(
        tmp_path / "wds",
        find_splits(tmp_path / "wds", []),
        IndexOptions(class_field="label", category_field="family"),
    )
    manifest = report.manifest
    assert manifest.categories == ("family0", "family1", "family2")
    assert sorted(c.name for c in manifest.classes) == sorted(f"species{i}" for i in range(12))
    assert manifest.split("train").samples == 36
    manifest.save(tmp_path / "wds")
    stream = ShardStream(
        tmp_path / "wds",
        12,
        schedule=ScheduleConfig(batches_per_pair=2, seed=1),
        transform=TINY,
        rank=0,
        world_size=1,
    )
    batches = list(stream.iter_worker(0, 1))
    assert len(batches) == 6 and all(b.images.shape[0] == 12 for b in batches)
    # The keys and the classes match what webdataset itself reads from the same tars.
    truth = {
        s["__key__"]: json.loads(s["json"])["label"]
        for s in wds.WebDataset(sorted(str(p) for p in (tmp_path / "wds").glob("*.tar")), shardshuffle=False)
    }
    names = {c.id: c.name for c in manifest.classes}
    for b in batches:
        assert all(truth[k] == names[int(c)] for k, c in zip(b.keys, b.labels))


def test_category_mapping_file_and_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_foreign(tmp_path / "wds", [(f"s{i}", "ignored") for i in range(6)])
    mapping = tmp_path / "map.csv"
    mapping.write_text(
        "class,category\n" + "".join(f"s{i},{'birds' if i < 3 else 'plants'}\n" for i in range(6))
    )
    code = main(
        [
            "shards",
            "index",
            str(tmp_path / "wds"),
            "--split",
            "train=part-*.tar",
            "--class-field",
            "label",
            "--category-map",
            str(mapping),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "birds" in out and "plants" in out
    assert Manifest.load(tmp_path / "wds").categories == ("birds", "plants")


def test_a_class_that_comes_back_later_is_two_spans(tmp_path: Path) -> None:
    write_foreign(tmp_path / "wds", [("a", "f"), ("b", "f"), ("a", "f")])
    manifest = index_shards(
        tmp_path / "wds", find_splits(tmp_path / "wds", []), IndexOptions(class_field="label")
    ).manifest
    (a,) = [c.id for c in manifest.classes if c.name == "a"]
    spans = [span for shard in manifest.split("train").shards for span in shard.classes if span.id == a]
    assert [span.count for span in spans] == [3, 3]
    assert manifest.split("train").class_counts[a] == 6
    with pytest.raises(ShardIndexError, match="--class-field"):
        index_shards(tmp_path / "wds", find_splits(tmp_path / "wds", []), IndexOptions(class_field="species"))


def test_a_v1_manifest_is_refused_then_upgraded(tmp_path: Path) -> None:
    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder

    write_image_folder(tmp_path / "images", [[2, 3, 4], [3, 3, 2]], image_size=8)
    built = build_shards(
        read_image_folder(tmp_path / "images"), tmp_path / "s", BuildOptions(progress=False)
    ).manifest
    data = json.loads((tmp_path / "s" / "manifest.json").read_text())
    data["version"] = 1
    for split in data["splits"].values():
        for shard in split["shards"]:
            shard["classes"] = [row[:2] for row in shard["classes"]]
    (tmp_path / "s" / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"shards index .* --upgrade"):
        Manifest.load(tmp_path / "s")
    upgraded = upgrade_manifest(tmp_path / "s")
    assert upgraded.to_json()["splits"] == built.to_json()["splits"]
    assert Manifest.load(tmp_path / "s").classes == built.classes


def test_long_member_names_go_through_pax_headers(tmp_path: Path) -> None:
    """Keys over 100 characters make tarfile write pax headers: the in-memory reader falls back to tarfile."""
    write_foreign(tmp_path / "wds", [(f"s{i}", "f") for i in range(4)], prefix="k" * 120)
    manifest = index_shards(
        tmp_path / "wds", find_splits(tmp_path / "wds", []), IndexOptions(class_field="label")
    ).manifest
    manifest.save(tmp_path / "wds")
    stream = ShardStream(
        tmp_path / "wds", 8, schedule=ScheduleConfig(strategy="random"), transform=TINY, rank=0, world_size=1
    )
    keys = [k for b in stream.iter_worker(0, 1) for k in b.keys]
    assert len(keys) == 8 and all(k.startswith("k" * 120) for k in keys)


def test_shards_behind_a_url_are_indexed_into_a_local_manifest(tmp_path: Path) -> None:
    """Object-storage style: tars at a URL, named with a brace range; the manifest lives on local disk and
    points at the URL, and training reads the classes from there."""
    from ddp_rank.data.reading.serve import serve_directory

    write_foreign(tmp_path / "bucket", [(f"s{i}", f"f{i % 2}") for i in range(8)], maxcount=6)
    tars = sorted(p.name for p in (tmp_path / "bucket").glob("*.tar"))
    assert tars == ["part-00000.tar", "part-00001.tar", "part-00002.tar", "part-00003.tar"]
    with serve_directory(tmp_path / "bucket") as url:
        code = main(
            [
                "shards", "index", url, "--split", "train=part-{00000..00003}.tar", "--class-field", "label",
                "--category-field", "family", "--out", str(tmp_path / "manifest"),
            ]
        )  # fmt: skip
        assert code == 0
        manifest = Manifest.load(tmp_path / "manifest")
        assert manifest.shards_root == url and manifest.split("train").samples == 24
        stream = ShardStream(
            tmp_path / "manifest",
            8,
            schedule=ScheduleConfig(batches_per_pair=2),
            transform=TINY,
            rank=0,
            world_size=1,
        )
        keys = [k for b in stream.iter_worker(0, 1) for k in b.keys]
    assert len(keys) == len(set(keys)) == 8 * stream.steps_per_epoch
    with pytest.raises(ShardIndexError, match="brace range"):
        find_splits("http://127.0.0.1:1/x", ["train=*.tar"])
    assert main(["shards", "index", "http://127.0.0.1:1/x", "--split", "train=a-{0..1}.tar"]) == 2


def _write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar of the given (name, data) members, in that order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _labelled(key: str, seed: int, meta: dict[str, str], image: bool = True) -> list[tuple[str, bytes]]:
    members = [(f"{key}.png", _image(seed, "PNG"))] if image else []
    return [*members, (f"{key}.json", json.dumps(meta).encode())]


def test_a_manifest_written_elsewhere_points_at_local_shards(tmp_path: Path) -> None:
    write_foreign(tmp_path / "wds", [(f"s{i}", f"f{i % 2}") for i in range(4)], maxcount=6)
    out = tmp_path / "manifest"
    code = main(["shards", "index", str(tmp_path / "wds"), "--class-field", "label", "--out", str(out)])
    assert code == 0
    manifest = Manifest.load(out)
    assert manifest.shards_root == str((tmp_path / "wds").resolve())
    assert main(["shards", "verify", str(out), "--workers", "1"]) == 0
    stream = ShardStream(
        out, 4, schedule=ScheduleConfig(strategy="random"), transform=TINY, rank=0, world_size=1
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a class that cannot be read is replaced with a warning
        assert len(next(stream.iter_worker(0, 1)).keys) == 4
    # Beside the shards (the default --out), the manifest needs no shards_root.
    assert main(["shards", "index", str(tmp_path / "wds"), "--class-field", "label"]) == 0
    assert Manifest.load(tmp_path / "wds").shards_root is None


def _corrupt_header(path: Path) -> None:
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[3].offset
    data = bytearray(path.read_bytes())
    data[offset : offset + 20] = b"\xff" * 20
    path.write_bytes(bytes(data))


def _cut_inside_member(path: Path) -> None:
    with tarfile.open(path) as tar:
        last = [m for m in tar.getmembers() if m.name.endswith(".png")][-1]
    path.write_bytes(path.read_bytes()[: last.offset_data + 10])


def _cut_between_members(path: Path) -> None:
    with tarfile.open(path) as tar:
        offset = tar.getmembers()[-2].offset
    path.write_bytes(path.read_bytes()[:offset])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_corrupt_header, "corrupt tar header at byte"),
        (_cut_inside_member, "cut short"),
        (_cut_between_members, "no end-of-archive marker"),
        (lambda p: p.write_bytes(b""), "empty file"),
    ],
)
def test_a_damaged_shard_is_refused_by_name(tmp_path: Path, damage: Any, problem: str) -> None:
    """A shard that ends early is refused, never indexed in part; the error names it and the way out."""
    write_foreign(tmp_path / "wds", [(f"s{i}", "f") for i in range(4)], maxcount=6)
    damage(tmp_path / "wds" / "part-00001.tar")
    with pytest.raises(ShardIndexError, match=rf"part-00001\.tar: .*{problem}.*re-create the shard"):
        index_shards(tmp_path / "wds", find_splits(tmp_path / "wds", []), IndexOptions(class_field="label"))


def test_invalid_json_names_the_shard_and_the_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    members = [m for n in range(3) for m in _labelled(f"k{n}", n, {"label": "a"})]
    members[3] = ("k1.json", b"{not json")
    _write_tar(tmp_path / "wds" / "x.tar", members)
    assert main(["shards", "index", str(tmp_path / "wds"), "--class-field", "label"]) == 2
    err = capsys.readouterr().err
    assert "x.tar: sample k1: k1.json is not valid JSON" in err and "Traceback" not in err


def test_cli_refuses_a_damaged_shard_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_foreign(tmp_path / "wds", [(f"s{i}", "f") for i in range(4)], maxcount=6)
    _cut_inside_member(tmp_path / "wds" / "part-00000.tar")
    assert main(["shards", "index", str(tmp_path / "wds"), "--class-field", "label"]) == 2
    assert "error: part-00000.tar: " in capsys.readouterr().err


def test_same_class_name_in_two_categories_is_two_classes(tmp_path: Path) -> None:
    members = [
        m
        for n in range(6)
        for m in _labelled(f"k{n}", n, {"label": "1", "category": "birds" if n < 3 else "plants"})
    ]
    _write_tar(tmp_path / "wds" / "x.tar", members)
    manifest = index_shards(
        tmp_path / "wds", find_splits(tmp_path / "wds", []), IndexOptions(class_field="label")
    ).manifest
    assert manifest.categories == ("birds", "plants")
    assert [(c.name, c.category) for c in manifest.classes] == [("1", 0), ("1", 1)]
    assert [(s.id, s.count) for s in manifest.split("train").shards[0].classes] == [(0, 3), (1, 3)]


def test_a_sample_without_an_image_does_not_split_its_class(tmp_path: Path) -> None:
    members = [
        m for n in range(6) for m in _labelled(f"k{n}", n, {"label": "a" if n < 3 else "b"}, image=n != 1)
    ]
    _write_tar(tmp_path / "wds" / "x.tar", members)
    report = index_shards(
        tmp_path / "wds", find_splits(tmp_path / "wds", []), IndexOptions(class_field="label")
    )
    assert report.skipped_samples == 1
    assert [(s.id, s.count) for s in report.manifest.split("train").shards[0].classes] == [(0, 2), (1, 3)]
    report.manifest.save(tmp_path / "wds")
    assert verify_shards(tmp_path / "wds") == []


def test_category_map_saved_by_excel_with_a_byte_order_mark(tmp_path: Path) -> None:
    mapping = tmp_path / "map.csv"
    mapping.write_text("class,category\ns0,birds\n", encoding="utf-8-sig")
    assert read_category_map(mapping) == {"s0": "birds"}


def test_class_ids_do_not_depend_on_the_hash_seed(tmp_path: Path) -> None:
    """Names whose natural keys tie ("7", "07", "007") are ordered by the raw name, in every process."""
    write_foreign(tmp_path / "wds", [(name, "f") for name in ("7", "07", "8", "007")], maxcount=100)
    script = (
        "import sys; from ddp_rank.data.building.shard_index import IndexOptions, find_splits, index_shards; "
        "m = index_shards(sys.argv[1], find_splits(sys.argv[1], []), IndexOptions(class_field='label')).manifest; "
        "print([c.name for c in m.classes])"
    )
    orders = set()
    for seed in range(6):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        done = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "wds")],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        orders.add(done.stdout.strip())
    assert orders == {"['007', '07', '7', '8']"}
