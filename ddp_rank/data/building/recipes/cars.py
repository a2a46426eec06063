"""Cars196 (Stanford Cars, Krause et al. 2013): ``cars_annos.mat`` and ``car_ims/``.

``cars_annos.mat`` is a MATLAB file (read with scipy) holding ``annotations``, one struct per image with
``relative_im_path`` (``car_ims/000001.jpg``), the bounding box (``bbox_x1`` ... ``bbox_y2``, unused), ``class``
(1-196) and ``test`` (the classification split, unused), and ``class_names``, 196 names such as
``AM General Hummer SUV 2000``: the name is the class. No categories. The split is the metric-learning one (Oh
Song et al. 2016): classes 1-98 by id (8,054 images) train, 99-196 (8,131 images) test. The devkit's
``cars_train_annos.mat`` / ``cars_test_annos.mat`` are the classification release, not this file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ddp_rank.data.building.listing import ListingError, Record
from ddp_rank.data.building.recipes.class_halves import split_of_class
from ddp_rank.extras import install_hint

ANNOTATIONS = "cars_annos.mat"


def _load(path: Path) -> dict[str, Any]:
    try:
        from scipy.io import loadmat
    except ImportError:
        raise ListingError(
            f"the cars recipe reads {ANNOTATIONS} with scipy, which is not installed: {install_hint('datasets')}"
        ) from None
    try:
        return dict(loadmat(path, squeeze_me=True))
    except (ValueError, TypeError, OSError) as exc:
        raise ListingError(f"{path}: not a MATLAB file scipy reads ({exc})") from None


def records(root: str | os.PathLike[str]) -> list[Record]:
    base = Path(root)
    path = base / ANNOTATIONS
    if not path.is_file():
        raise ListingError(f"{path} not found: ROOT must be the Cars196 folder ({ANNOTATIONS} and car_ims/)")
    mat = _load(path)
    missing = [key for key in ("annotations", "class_names") if key not in mat]
    if missing:
        raise ListingError(
            f"{path}: no {missing} variable(s) (it has {sorted(k for k in mat if not k.startswith('__'))}): "
            f"the recipe reads the {ANNOTATIONS} released with car_ims, not the devkit's per-split files"
        )
    annotations = np.atleast_1d(mat["annotations"])
    fields = annotations.dtype.names or ()
    if "relative_im_path" not in fields or "class" not in fields:
        raise ListingError(
            f"{path}: annotations have the fields {list(fields)}, not relative_im_path and class"
        )
    names = [str(name).strip() for name in np.atleast_1d(mat["class_names"])]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ListingError(f"{path}: class_names repeats {repeated}; each class needs a name of its own")
    ids = [int(a["class"]) for a in annotations]
    unnamed = sorted({cid for cid in ids if not 1 <= cid <= len(names)})
    if unnamed:
        raise ListingError(f"{path}: class id(s) {unnamed[:5]} outside 1..{len(names)} (class_names)")
    split_of = split_of_class(ids, path)
    return [
        Record(path=str(base / str(a["relative_im_path"])), cls=names[cid - 1], split=split_of[cid])
        for a, cid in zip(annotations, ids)
    ]
