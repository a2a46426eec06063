"""Each dataset recipe on a tiny fake copy of that dataset's own file layout (no network, no real data)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from ddp_rank.cli import main
from ddp_rank.data.building.build import BuildOptions, build_shards
from ddp_rank.data.building.listing import ListingError, read_csv_listing
from ddp_rank.data.building.recipes import emoji, inshop, npm, run_recipe, sop, vehicleid
from ddp_rank.data.building.synthetic import write_image_folder
from ddp_rank.data.format.manifest import Manifest


def _image(path: Path) -> None:
    write_image_folder(path.parent / "_tmp", [[1]], image_size=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "_tmp" / "cat0" / "cls0_0" / "0000.png").rename(path)


def test_sop(tmp_path: Path) -> None:
    rows = {
        "train": [
            (1, 1, "bicycle_final/1_0.JPG"),
            (1, 1, "bicycle_final/1_1.JPG"),
            (2, 2, "chair_final/2_0.JPG"),
            (2, 2, "chair_final/2_1.JPG"),
        ],
        "test": [(3, 1, "bicycle_final/3_0.JPG"), (3, 1, "bicycle_final/3_1.JPG")],
    }
    for split, items in rows.items():
        lines = ["image_id class_id super_class_id path"] + [
            f"{i} {c} {s} {p}" for i, (c, s, p) in enumerate(items)
        ]
        (tmp_path / sop.SPLIT_FILES[split]).write_text("\n".join(lines) + "\n")
    records = sop.records(tmp_path)
    assert [(r.cls, r.category, r.split) for r in records[:3]] == [
        ("1", "bicycle", "train"),
        ("1", "bicycle", "train"),
        ("2", "chair", "train"),
    ]
    assert records[-1].path == str(tmp_path / "bicycle_final/3_1.JPG") and records[-1].split == "test"
    (tmp_path / "Ebay_test.txt").write_text("image_id class_id super_class_id path\n1 2 3\n")
    with pytest.raises(ListingError, match=r"Ebay_test\.txt:2"):
        sop.records(tmp_path)


def test_inshop(tmp_path: Path) -> None:
    lines = [
        "6",
        "image_name item_id evaluation_status",
        "img/WOMEN/Dresses/id_01/01_1_front.jpg id_01 train",
        "img/WOMEN/Dresses/id_01/01_2_side.jpg id_01 train",
        "img/WOMEN/Skirts/id_01/01_3_back.jpg id_01 train",
        "img/MEN/Denim/id_02/02_1_front.jpg id_02 query",
        "img/MEN/Denim/id_02/02_2_side.jpg id_02 gallery",
        "img/MEN/Denim/id_02/02_3_back.jpg id_02 gallery",
    ]
    (tmp_path / "Eval").mkdir()
    (tmp_path / "Eval" / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    (tmp_path / "Img").mkdir()
    records = inshop.records(tmp_path)
    assert {r.category for r in records if r.cls == "id_01"} == {"WOMEN/Dresses"}, "majority category"
    test = [(r.split, r.subset) for r in records if r.cls == "id_02"]
    assert test == [("test", "query"), ("test", "gallery"), ("test", "gallery")]
    assert records[0].path == str(tmp_path / "Img" / "img/WOMEN/Dresses/id_01/01_1_front.jpg")


def test_vehicleid(tmp_path: Path) -> None:
    (tmp_path / "attribute").mkdir()
    (tmp_path / "attribute" / "model_attr.txt").write_text("10 7\n11 7\n")
    (tmp_path / "train_test_split").mkdir()
    lists = {
        "train_list.txt": "a 10\nb 10\nc 12\nd 12\n",
        "test_list_800.txt": "e 11\nf 11\n",
        "test_list_1600.txt": "e 11\nf 11\ng 13\nh 13\n",
        "test_list_2400.txt": "e 11\nf 11\n",
    }
    for name, text in lists.items():
        (tmp_path / "train_test_split" / name).write_text(text)
    records = vehicleid.records(tmp_path)
    train = [(r.cls, r.category) for r in records if r.split == "train"]
    assert train == [("10", "model_7"), ("10", "model_7"), ("12", None), ("12", None)]
    assert sorted({r.split for r in records}) == ["test_large", "test_medium", "test_small", "train"]
    assert records[0].path == str(tmp_path / "image" / "a.jpg")


SVG = (
    '<svg xmlns="http://www.w3.org/2000/svg" width="72" height="72" viewBox="0 0 72 72">'
    '<circle cx="36" cy="36" r="{r}" fill="{fill}"/></svg>'
)


def _fake_packages(cache: Path) -> None:
    """The three npm tarballs with the members the recipe reads, under their pinned names."""
    emojis = [
        {
            "unified": "1F600",
            "non_qualified": None,
            "image": "1f600.png",
            "category": "Smileys & Emotion",
            "sort_order": 1,
        },
        {
            "unified": "1F601",
            "non_qualified": None,
            "image": "1f601.png",
            "category": "Smileys & Emotion",
            "sort_order": 2,
        },
        {
            "unified": "1F436",
            "non_qualified": None,
            "image": "1f436.png",
            "category": "Animals & Nature",
            "sort_order": 3,
        },
        {
            "unified": "2764-FE0F",
            "non_qualified": "2764",
            "image": "2764-fe0f.png",
            "category": "Symbols",
            "sort_order": 4,
        },
    ]
    png_dir = cache / "_png"
    for e in emojis:
        _image(png_dir / e["image"])
    cache.mkdir(parents=True, exist_ok=True)
    for key, (name, version) in emoji.PACKAGES.items():
        members: dict[str, bytes] = {}
        if key in ("google", "twitter"):
            members["package/emoji.json"] = json.dumps(emojis).encode()
            members["package/img/google/sheets/big.png"] = b"not needed"
            for e in emojis:
                members[f"package/img/{key}/64/{e['image']}"] = (png_dir / e["image"]).read_bytes()
        else:
            for i, e in enumerate(emojis):
                code = e["non_qualified"] or e["unified"]  # openmoji names some by the non-qualified code
                for style, fill in (("color", "#fc0"), ("black", "#000")):
                    members[f"package/{style}/svg/{code}.svg"] = SVG.format(r=10 + 5 * i, fill=fill).encode()
        with tarfile.open(cache / f"{name}-{version}.tgz", "w:gz") as tar:
            for member_name, data in members.items():
                info = tarfile.TarInfo(member_name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_emoji_without_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("cairosvg")
    cache = tmp_path / "cache"
    _fake_packages(cache)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("npm must not run when the tarballs are cached")

    monkeypatch.setattr(subprocess, "run", no_network)
    records = emoji.records(cache, size=16, test_fraction=0.5, seed=0, workers=1)
    assert len(records) == 16  # 4 emoji x 4 vendors
    assert {r.cls for r in records} == {"1f600", "1f601", "1f436", "2764-fe0f"}
    assert {r.category for r in records if r.cls == "1f436"} == {"Animals & Nature"}
    renders = sorted(p.relative_to(cache).as_posix() for p in (cache / "render-16").rglob("*.png"))
    assert len(renders) == 8 and "render-16/openmoji-black/2764-fe0f.png" in renders
    splits = {r.cls: r.split for r in records}
    assert sorted(splits.values()).count("test") == 1  # round(0.5 * classes) per category: 1 of 2 smileys
    assert not list(cache.rglob("*.partial"))
    out_csv = tmp_path / "emoji.csv"
    assert (
        main(["shards", "listing", "emoji", str(cache), str(out_csv), "--size", "16", "--workers", "1"]) == 0
    )
    result = build_shards(read_csv_listing(out_csv), tmp_path / "shards", BuildOptions(progress=False))
    manifest = Manifest.load(tmp_path / "shards")
    assert result.manifest.split("train").samples + manifest.split("test").samples == 16
    assert set(manifest.categories) == {"Smileys & Emotion", "Animals & Nature", "Symbols"}


def test_emoji_runs_npm_pack_when_not_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []

    def fake_npm(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        _fake_packages(tmp_path / "made")
        name = cmd[2].replace("@", "-")
        (tmp_path / "made" / f"{name}.tgz").rename(Path(cmd[4]) / f"{name}.tgz")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(npm.shutil, "which", lambda name: "/usr/bin/npm")
    monkeypatch.setattr(npm.subprocess, "run", fake_npm)
    records = emoji.records(tmp_path / "cache", vendors=("google", "twitter"), workers=1)
    assert [c[:3] for c in calls] == [
        ["npm", "pack", "emoji-datasource-google@16.0.0"],
        ["npm", "pack", "emoji-datasource-twitter@16.0.0"],
    ]
    assert len(records) == 8
    with pytest.raises(ListingError, match="unknown vendor"):
        emoji.records(tmp_path / "cache", vendors=("apple",))


def test_unknown_recipe() -> None:
    with pytest.raises(KeyError, match="choose one of"):
        run_recipe("imagenet", ".")


def _inat_tree(root: Path) -> dict[str, list[str]]:
    """train_val2018/<supercategory>/<class id>/<hash>.jpg: 3 supercategories x 4 classes x 3 images."""
    layout: dict[str, list[str]] = {}
    for s, supercategory in enumerate(("Aves", "Plantae", "Insecta")):
        for c in range(4):
            class_id = str(1000 * s + c)
            for k in range(3):
                rel = f"train_val2018/{supercategory}/{class_id}/{k:032x}.jpg"
                _image(root / rel)
                layout.setdefault(class_id, []).append(rel)
    (root / "train_val2018" / "Aves" / ".DS_Store").write_bytes(b"x")
    return layout


def test_inat_seeded_split_by_class(tmp_path: Path) -> None:
    layout = _inat_tree(tmp_path)
    records = run_recipe("inat", str(tmp_path), test_fraction=0.5, seed=1)
    assert len(records) == 36 and {r.category for r in records} == {"Aves", "Plantae", "Insecta"}
    split_of = {(r.cls, r.split) for r in records}
    assert len(split_of) == 12, "a class is never in both splits"
    per_category = {(r.category, r.split) for r in records}
    assert len(per_category) == 6, "every supercategory in both splits (stratified)"
    assert records == run_recipe("inat", str(tmp_path), test_fraction=0.5, seed=1)
    assert {r.path for r in records} == {str(tmp_path / rel) for rels in layout.values() for rel in rels}


def test_inat_published_split_files_and_round_trip(tmp_path: Path) -> None:
    layout = _inat_tree(tmp_path)
    train = [rel for cid in ("0", "1", "1000", "2000", "2001") for rel in layout[cid]]
    (tmp_path / "train.txt").write_text("\n".join(train) + "\n")
    (tmp_path / "test.txt").write_text("1001\n2002\n")  # class ids work too
    out = tmp_path / "inat.csv"
    code = main(["shards", "listing", "inat", str(tmp_path), str(out), "--train-list", str(tmp_path / "train.txt"),
                 "--test-list", str(tmp_path / "test.txt")])  # fmt: skip
    assert code == 0
    records = read_csv_listing(out)
    assert {r.cls for r in records if r.split == "train"} == {"0", "1", "1000", "2000", "2001"}
    assert {r.cls for r in records if r.split == "test"} == {"1001", "2002"}
    manifest = build_shards(records, tmp_path / "shards", BuildOptions(progress=False)).manifest
    assert manifest.categories == ("Aves", "Insecta", "Plantae")
    assert manifest.split("train").samples == 15 and manifest.split("test").samples == 6
    with pytest.raises(ListingError, match="both --train-list and --test-list"):
        run_recipe("inat", str(tmp_path), train_list=str(tmp_path / "train.txt"))
    with pytest.raises(ListingError, match="train_val2018"):
        run_recipe("inat", str(tmp_path / "nowhere"))
