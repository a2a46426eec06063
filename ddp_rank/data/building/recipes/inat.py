"""iNaturalist 2018 for metric learning (as in Smooth-AP, Brown et al. 2020, and ROADMAP).

The dataset's own image folder is ``train_val2018/<supercategory>/<category_id>/<image>.jpg``: 8,142 species
(classes) in 14 supercategories (Plantae, Aves, Insecta, ...), 461,939 images over the challenge's train (437,513)
and val (24,426) sets. Metric learning uses them all, split by class: Smooth-AP's split has 5,690 training classes (325,846
images) and 2,452 test classes (136,093 images). The supercategories are the categories of the hard sampler.

With ``train_list`` / ``test_list`` (the published split files: one line per image path relative to ROOT, or one
class id per line) the split is exactly theirs; otherwise the classes are split at random, seeded, stratified by
supercategory, with ``test_fraction`` (default 0.3, Smooth-AP's proportion of test classes) held out.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddp_rank.data.building.listing import FOLDER_IMAGE_SUFFIXES, ListingError, Record, assign_splits

IMAGE_ROOT = "train_val2018"
DEFAULT_TEST_FRACTION = 0.3


def _walk(base: Path) -> list[Record]:
    images = base / IMAGE_ROOT
    if not images.is_dir():
        raise ListingError(f"{images} not found: ROOT must be the folder that holds {IMAGE_ROOT}/")
    out = []
    for path in sorted(images.glob("*/*/*")):
        if path.suffix.lower() in FOLDER_IMAGE_SUFFIXES and not path.name.startswith("."):
            supercategory, class_id = path.parent.parent.name, path.parent.name
            out.append(Record(path=str(path), cls=class_id, category=supercategory))
    if not out:
        raise ListingError(f"no images under {images}/<supercategory>/<category_id>/")
    return out


def _read_list(path: str | os.PathLike[str]) -> tuple[set[str], set[str]]:
    """(image paths, class ids) named by a split file; a line is either."""
    listed = Path(path)
    if not listed.is_file():
        raise ListingError(f"split file {listed} not found")
    images, classes = set(), set()
    for line in listed.read_text(encoding="utf-8").splitlines():
        entry = line.strip().split(",")[0].strip()
        if not entry:
            continue
        if Path(entry).suffix.lower() in FOLDER_IMAGE_SUFFIXES:
            images.add(os.path.normpath(entry))
        else:
            classes.add(entry)
    return images, classes


def records(
    root: str | os.PathLike[str],
    train_list: str | os.PathLike[str] | None = None,
    test_list: str | os.PathLike[str] | None = None,
    test_fraction: float = DEFAULT_TEST_FRACTION,
    seed: int = 0,
) -> list[Record]:
    base = Path(root)
    everything = _walk(base)
    if (train_list is None) != (test_list is None):
        raise ListingError("give both --train-list and --test-list, or neither (then the split is seeded)")
    if train_list is None or test_list is None:
        return assign_splits(everything, test_fraction, seed)
    named = {"train": _read_list(train_list), "test": _read_list(test_list)}
    out = []
    for r in everything:
        rel = os.path.normpath(os.path.relpath(r.path, base))
        splits = [s for s, (images, classes) in named.items() if rel in images or r.cls in classes]
        if len(splits) > 1:
            raise ListingError(f"{rel} is in both the train and the test list")
        if splits:
            out.append(Record(r.path, r.cls, r.category, split=splits[0]))
    if not out:
        raise ListingError(f"no image under {base / IMAGE_ROOT} is named by {train_list} or {test_list}")
    return out
