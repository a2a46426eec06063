"""CUB-200-2011 (Wah et al. 2011): ``images.txt``, ``image_class_labels.txt``, ``classes.txt`` and ``images/``.

``images.txt`` lines are ``<image_id> <path under images/>``, ``image_class_labels.txt`` lines
``<image_id> <class_id>`` and ``classes.txt`` lines ``<class_id> <class_name>`` (``14 014.Indigo_Bunting``); the
class name is the class. No categories. The split is the metric-learning one (Oh Song et al. 2016): the first
half of the classes by id (1-100, 5,864 images) train, the second half (101-200, 5,924 images) test. The
dataset's own ``train_test_split.txt`` divides each class's images for classification, and is not used.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddp_rank.data.building.listing import ListingError, Record
from ddp_rank.data.building.recipes.class_halves import split_of_class

INDEX_FILES = ("images.txt", "image_class_labels.txt", "classes.txt")


def _root(base: Path) -> Path:
    """ROOT itself, or the ``CUB_200_2011`` folder the archive unpacks to, if ROOT holds it."""
    for candidate in (base, base / "CUB_200_2011"):
        if all((candidate / name).is_file() for name in INDEX_FILES):
            return candidate
    missing = [name for name in INDEX_FILES if not (base / name).is_file()]
    raise ListingError(
        f"{', '.join(missing)} not found in {base}: ROOT must be the CUB_200_2011 folder "
        "(images.txt, image_class_labels.txt, classes.txt, images/)"
    )


def _pairs(path: Path) -> list[tuple[int, str]]:
    """``<id> <text>`` lines (the text may hold spaces), ids as numbers."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        first, _, rest = line.strip().partition(" ")
        if not first.isdigit() or not rest.strip():
            raise ListingError(f"{path}:{n}: expected '<id> <value>', got {line!r}")
        out.append((int(first), rest.strip()))
    return out


def records(root: str | os.PathLike[str]) -> list[Record]:
    base = _root(Path(root))
    images = _pairs(base / "images.txt")
    label_of: dict[int, int] = {}
    for image, text in _pairs(base / "image_class_labels.txt"):
        if not text.isdigit():
            raise ListingError(
                f"{base / 'image_class_labels.txt'}: image {image} has class {text!r}, not a number"
            )
        label_of[image] = int(text)
    name_of = dict(_pairs(base / "classes.txt"))
    split_of = split_of_class(sorted(name_of), base / "classes.txt")
    out = []
    for image, rel in images:
        if image not in label_of:
            raise ListingError(f"{base / 'image_class_labels.txt'}: image {image} ({rel}) has no class line")
        label = label_of[image]
        if label not in name_of:
            raise ListingError(f"{base / 'classes.txt'}: class {label} (of image {image}) is not named")
        out.append(Record(path=str(base / "images" / rel), cls=name_of[label], split=split_of[label]))
    return out
