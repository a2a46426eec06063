"""Loading the authors' reference vectors (tests/assets/reference, see its README) as test cases.

The vectors live inside the repository so that a clone tests itself; ``DDP_RANK_REFERENCE_DIR`` may point at
another copy. ``manifest.json`` lists every file: a folder with fewer is an error, not a shorter test list."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddp_rank.losses import FastAPLoss, ListwiseLoss, PNPLoss, SmoothAPLoss

REFERENCE_DIR = Path(
    os.environ.get("DDP_RANK_REFERENCE_DIR", Path(__file__).resolve().parents[1] / "assets" / "reference")
)


@dataclass(frozen=True)
class ReferenceCase:
    """One reference file and the ddp_rank loss that must reproduce it."""

    file: str
    embeddings: np.ndarray
    labels: np.ndarray
    loss: float
    grad: np.ndarray  # the gradient our loss must equal (see ``_expected_grad``)
    loss_fp32: float | None
    n_valid: int
    module: ListwiseLoss


def reference_files() -> list[str]:
    """Every file ``manifest.json`` lists; raises (at collection) when the folder or any listed file is missing."""
    manifest = REFERENCE_DIR / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(
            f"no reference vectors at {REFERENCE_DIR} (manifest.json missing): they ship in tests/assets/reference; "
            "unset DDP_RANK_REFERENCE_DIR or point it at a complete copy"
        )
    listed = sorted({entry["file"] for entry in json.loads(manifest.read_text())})
    missing = [name for name in listed if not (REFERENCE_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{len(missing)} reference file(s) listed in {manifest} are missing, e.g. {missing[0]}"
        )
    return listed


def load_case(file: str) -> ReferenceCase:
    data = np.load(REFERENCE_DIR / file)
    return ReferenceCase(
        file=file,
        embeddings=data["embeddings"],
        labels=data["labels"],
        loss=float(data["loss"]),
        grad=_expected_grad(file, data),
        loss_fp32=float(data["loss_fp32"]) if "loss_fp32" in data.files else None,
        n_valid=int(data["n_valid_queries"]),
        module=_module_for(file, data),
    )


def _expected_grad(file: str, data: np.lib.npyio.NpzFile) -> np.ndarray:
    # The authors' FastAP backward is not the gradient of their loss (tests/assets/reference/README.md): compare with the true one.
    if file.startswith("fastap_official"):
        return data["grad_autograd"]
    return data["grad"]


def _module_for(file: str, data: np.lib.npyio.NpzFile) -> ListwiseLoss:
    # PML normalises inside (CosineSimilarity / LpDistance); the authors' code takes the rows as given.
    normalize = "_pml__" in file
    if file.startswith("fastap"):
        return FastAPLoss(int(data["num_bins"]), normalize=normalize)
    if file.startswith("pnp"):
        variant = file.split("__")[-1].removesuffix(".npz").split("_")[0]
        return PNPLoss(
            variant,
            tau=float(data["tau"]),
            b=float(data["b"]),
            alpha=float(data["alpha"]),
            normalize=normalize,
        )
    if file.startswith("smoothap"):
        return SmoothAPLoss(tau=float(data["tau"]), normalize=normalize)
    raise ValueError(f"no ddp_rank loss for reference file {file}")
