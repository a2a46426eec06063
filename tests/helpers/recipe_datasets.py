"""Tiny fake copies of SOP, In-Shop and VehicleID in their own file layouts, turned into shards by the recipes
through ``ddp-rank shards listing`` / ``ddp-rank shards build`` (no network, no real data)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from ddp_rank.cli import main


def _jpg(path: Path, colour: int, k: int, size: int = 16) -> None:
    rng = np.random.default_rng(colour * 100 + k)
    base = np.array([(colour * 53) % 256, (colour * 97) % 256, (colour * 151) % 256])
    pixels = np.clip(base + rng.integers(0, 48, size=(size, size, 3)), 0, 255).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, quality=95)


def fake_sop(root: Path) -> Path:
    """2 super classes, 3 train and 3 test products each, 3 images per product."""
    for split, offset in (("train", 0), ("test", 10)):
        lines = ["image_id class_id super_class_id path"]
        for cat, name in enumerate(("bicycle", "chair")):
            for j in range(3):
                cls = offset + cat * 3 + j
                for k in range(3):
                    rel = f"{name}_final/{cls}_{k}.JPG"
                    _jpg(root / rel, cls, k)
                    lines.append(f"{len(lines)} {cls} {cat + 1} {rel}")
        (root / f"Ebay_{split}.txt").write_text("\n".join(lines) + "\n")
    return root


def fake_inshop(root: Path) -> Path:
    """4 train items, 4 test items with one query and two gallery images each."""
    rows = []
    for item in range(8):
        kind = ("WOMEN/Dresses", "MEN/Denim")[item % 2]
        status = ["train"] * 3 if item < 4 else ["query", "gallery", "gallery"]
        for k, st in enumerate(status):
            rel = f"img/{kind}/id_{item:02d}/{k:02d}_front.jpg"
            _jpg(root / "Img" / rel, item, k)
            rows.append(f"{rel} id_{item:02d} {st}")
    (root / "Eval").mkdir(parents=True, exist_ok=True)
    lines = [str(len(rows)), "image_name item_id evaluation_status", *rows]
    (root / "Eval" / "list_eval_partition.txt").write_text("\n".join(lines) + "\n")
    return root


def fake_vehicleid(root: Path) -> Path:
    """4 train vehicles (2 with a model), test lists of 2 / 4 / 6 vehicles with 3 images each (nested)."""
    (root / "attribute").mkdir(parents=True, exist_ok=True)
    (root / "attribute" / "model_attr.txt").write_text("0 7\n1 7\n")
    split_dir = root / "train_test_split"
    split_dir.mkdir(exist_ok=True)

    def lines(vehicles: range) -> str:
        out = []
        for v in vehicles:
            for k in range(3):
                _jpg(root / "image" / f"v{v}_{k}.jpg", v, k)
                out.append(f"v{v}_{k} {v}")
        return "\n".join(out) + "\n"

    (split_dir / "train_list.txt").write_text(lines(range(4)))
    (split_dir / "test_list_800.txt").write_text(lines(range(10, 12)))
    (split_dir / "test_list_1600.txt").write_text(lines(range(10, 14)))
    (split_dir / "test_list_2400.txt").write_text(lines(range(10, 16)))
    return root


FAKES = {"sop": fake_sop, "inshop": fake_inshop, "vehicleid": fake_vehicleid}


def recipe_shards(recipe: str, tmp: Path) -> Path:
    """Fake dataset -> listing CSV -> shards, all through the ``ddp-rank shards`` commands."""
    root = FAKES[recipe](tmp / f"{recipe}-raw")
    listing = tmp / f"{recipe}.csv"
    out = tmp / f"{recipe}-shards"
    assert main(["shards", "listing", recipe, str(root), str(listing)]) == 0
    assert main(["shards", "build", str(listing), str(out), "--workers", "1", "--no-progress"]) == 0
    return out


def _tgz(path: Path, members: dict[str, bytes]) -> None:
    import io
    import tarfile

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def fake_words_packages(cache: Path, tiers: dict[int, list[str]], fonts: tuple[str, ...]) -> Path:
    """The word-list tarball (``tiers``: SCOWL tier -> words; missing tiers are empty) and one tarball per font
    in ``fonts``, under the names ``npm pack`` gives them. Every font is Pillow's own Aileron (the TrueType
    bytes of ``ImageFont.load_default``; FreeType reads a font by its content, whatever the suffix): a real
    font that needs no network and no system package."""
    import json

    from PIL import ImageFont

    from ddp_rank.data.building.recipes import npm, words

    package, version = words.WORD_LIST
    _tgz(
        cache / npm.tarball_name(package, version),
        {
            f"package/english-words-{t}.json": json.dumps(tiers.get(t, [])).encode()
            for t in words.WORD_TIERS
        }
        | {"package/README.md": b"not read"},
    )
    font_bytes = ImageFont.load_default(12).font_bytes  # type: ignore[union-attr]
    for name in fonts:
        font = words.FONTS[name]
        _tgz(
            cache / npm.tarball_name(font.package, font.version),
            {f"package/{font.file}": font_bytes, "package/LICENSE": b"OFL"},
        )
    return cache
