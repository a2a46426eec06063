"""CUB-200-2011 and Cars196 through the command line, on miniature copies of each dataset's real file layout.

A few classes under their real names and ids, tiny images written here, and for Cars196 a ``cars_annos.mat``
written with scipy in the released structure. Each is listed (``shards listing``) and built (``shards build``),
and the manifest must carry the real class names and the field's split: the first half of the class ids
train, the second half test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ddp_rank.cli import main
from ddp_rank.config import load_config
from ddp_rank.data.building.listing import ListingError
from ddp_rank.data.building.recipes import cars, cub
from ddp_rank.data.building.recipes.class_halves import split_of_class
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.protocols import PROTOCOL_KS

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

CUB_CLASSES = {
    1: "001.Black_footed_Albatross",
    2: "002.Laysan_Albatross",
    14: "014.Indigo_Bunting",
    15: "015.Lazuli_Bunting",
}
CARS_CLASSES = {
    1: "AM General Hummer SUV 2000",
    2: "Acura RL Sedan 2012",
    3: "Acura TL Sedan 2012",
    4: "Acura TL Type-S 2008",
}


def _jpg(path: Path, shade: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), (shade, 255 - shade, 90)).save(path, format="JPEG")


def _cub(root: Path, per_class: int = 2) -> Path:
    """``CUB_200_2011/`` as the archive unpacks it: the three index files and ``images/<class>/<file>.jpg``."""
    base = root / "CUB_200_2011"
    images, labels = [], []
    for class_id, name in CUB_CLASSES.items():
        for k in range(per_class):
            rel = f"{name}/{name.split('.', 1)[1]}_{k:04d}_{class_id}.jpg"
            _jpg(base / "images" / rel, 20 * class_id + k)
            image_id = len(images) + 1
            images.append(f"{image_id} {rel}")
            labels.append(f"{image_id} {class_id}")
    (base / "images.txt").write_text("\n".join(images) + "\n")
    (base / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (base / "classes.txt").write_text("\n".join(f"{i} {n}" for i, n in CUB_CLASSES.items()) + "\n")
    return base


def _cars(root: Path, class_names: dict[int, str] = CARS_CLASSES) -> Path:
    """``cars_annos.mat`` as released (a 1 x N struct array ``annotations`` and a 1 x 196 cell array
    ``class_names``, here with 4 names) beside ``car_ims/000001.jpg`` ..."""
    scipy_io = pytest.importorskip("scipy.io")
    class_ids = [class_id for class_id in class_names for _ in range(2)]
    fields = ["relative_im_path", "bbox_x1", "bbox_y1", "bbox_x2", "bbox_y2", "class", "test"]
    annotations = np.zeros((1, len(class_ids)), dtype=[(f, object) for f in fields])
    for i, class_id in enumerate(class_ids):
        rel = f"car_ims/{i + 1:06d}.jpg"
        _jpg(root / rel, 30 * class_id + i)
        row = annotations[0, i]
        row["relative_im_path"] = rel
        for f, v in zip(fields[1:5], (1, 2, 7, 5)):
            row[f] = np.array([[v]], dtype=np.uint16)
        row["class"] = np.array([[class_id]], dtype=np.uint8)
        row["test"] = np.array([[i % 2]], dtype=np.uint8)
    names = np.empty((1, len(class_names)), dtype=object)
    for i, name in enumerate(class_names.values()):
        names[0, i] = name
    scipy_io.savemat(root / "cars_annos.mat", {"annotations": annotations, "class_names": names})
    return root


def _list_and_build(recipe: str, root: Path, tmp_path: Path) -> Manifest:
    listing = tmp_path / f"{recipe}.csv"
    assert main(["shards", "listing", recipe, str(root), str(listing)]) == 0
    out = tmp_path / f"{recipe}-shards"
    assert main(["shards", "build", str(listing), str(out), "--workers", "1", "--no-progress"]) == 0
    return Manifest.load(out)


def _names(manifest: Manifest, split: str) -> set[str]:
    return {manifest.classes[cid].name for cid in manifest.split(split).class_counts}


def test_cub_listing_and_build_keep_the_names_and_split_the_class_halves(tmp_path: Path) -> None:
    _cub(tmp_path / "data")
    manifest = _list_and_build("cub", tmp_path / "data", tmp_path)  # ROOT holding CUB_200_2011/ is found too
    assert _names(manifest, "train") == {"001.Black_footed_Albatross", "002.Laysan_Albatross"}
    assert _names(manifest, "test") == {"014.Indigo_Bunting", "015.Lazuli_Bunting"}
    assert manifest.categories == () and manifest.split("test").samples == 4


def test_cars_listing_and_build_keep_the_names_and_split_the_class_halves(tmp_path: Path) -> None:
    _cars(tmp_path / "cars")
    manifest = _list_and_build("cars", tmp_path / "cars", tmp_path)
    assert _names(manifest, "train") == {"AM General Hummer SUV 2000", "Acura RL Sedan 2012"}
    assert _names(manifest, "test") == {"Acura TL Sedan 2012", "Acura TL Type-S 2008"}
    assert manifest.split("train").samples == 4


def test_cars_split_follows_the_ids_not_the_names(tmp_path: Path) -> None:
    """Class 4's name sorts first: the split is still by id (1-2 train, 3-4 test)."""
    root = _cars(tmp_path, {**CARS_CLASSES, 4: "AAA First By Name 1999"})
    split = {r.cls: r.split for r in cars.records(root)}
    assert split["AAA First By Name 1999"] == "test" and split["AM General Hummer SUV 2000"] == "train"


def test_cub_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(ListingError, match=r"images\.txt.*ROOT must be the CUB_200_2011 folder"):
        cub.records(tmp_path)
    base = _cub(tmp_path)
    (base / "image_class_labels.txt").write_text("1 one\n")
    with pytest.raises(ListingError, match=r"image_class_labels\.txt: image 1 has class 'one'"):
        cub.records(base)


def test_cars_without_scipy_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cars_annos.mat").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "scipy.io", None)  # import scipy.io now raises ImportError
    with pytest.raises(ListingError) as caught:
        cars.records(tmp_path)
    assert str(caught.value).count("\n") == 0
    assert 'pip install -c constraints.txt -e ".[datasets]"' in str(caught.value)


def test_cars_file_of_another_release_is_named(tmp_path: Path) -> None:
    scipy_io = pytest.importorskip("scipy.io")
    scipy_io.savemat(tmp_path / "cars_annos.mat", {"annotations": np.zeros((1, 2))})
    with pytest.raises(ListingError, match=r"no \['class_names'\] variable"):
        cars.records(tmp_path)


def test_class_halves() -> None:
    assert split_of_class([3, 1, 2], Path("x")) == {1: "train", 2: "train", 3: "test"}
    assert list(split_of_class(list(range(1, 201)), Path("x")).values()).count("test") == 100
    with pytest.raises(ListingError, match="at least 2"):
        split_of_class([5], Path("x"))


@pytest.mark.parametrize("dataset", ["cub", "cars"])
def test_configs_hold_the_fields_settings(dataset: str) -> None:
    """Musgrave et al. 2020's settings (128-d, 8 classes x 4 images, a 227 crop of 256, frozen BatchNorm),
    scored with Recall@1, 2, 4, 8 and MAP@R, each test image querying the rest."""
    (path,) = CONFIGS.glob(f"{dataset}_*.yaml")
    cfg = load_config(path)
    assert (cfg.eval.protocol, cfg.eval.ks, cfg.eval.map_at_r) == ("sop", [1, 2, 4, 8], True)
    assert (cfg.model.embedding_dim, cfg.model.freeze_bn) == (128, "always")
    assert (cfg.data.global_batch_size, cfg.data.sampler, cfg.data.images_per_class) == (32, "pk", 4)
    assert (cfg.data.image_size, cfg.data.resize_size, cfg.data.crop) == (227, 256, "paper")


def test_sop_and_inshop_configs_report_their_fields_recall_ks() -> None:
    for stem, ks in (
        ("sop_fastap_resnet18_m256", (1, 10, 100, 1000)),
        ("inshop_fastap_resnet50_m256", (1, 10, 20, 30, 40, 50)),
    ):
        cfg = load_config(CONFIGS / f"{stem}.yaml")
        assert tuple(cfg.eval.ks or PROTOCOL_KS[cfg.eval.protocol]) == ks
