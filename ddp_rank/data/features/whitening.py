"""PCA whitening of feature vectors: fitted once on a split of a feature shard set, stored beside its vectors.

Why: a head trained on a frozen backbone's raw vectors learns slowly, because those vectors are strongly
correlated and of very unequal variances, so every gradient step is badly conditioned. Whitened (centred,
rotated onto the principal axes and scaled to unit variance on each), the same head reaches its plateau in a
few epochs. Measured by the word study (``make study-features``: the word set's EfficientNet-Lite0 grid
features, 1,792 values, a linear FastAP head at batch 1,024, its rate swept): on the raw vectors 75.35 R@1 after
8 epochs, still gaining 1.5 points over the last quarter; on the whitened ones 80.77, flat (0.3) at 4 epochs
(``benchmarks/results/study-features-2026-11-26-findings.md``, "Whitening").

The map is ``w = (v - mean) @ projection``: ``projection`` is ``[D, K]``, the top ``K`` eigenvectors of the
covariance divided by ``sqrt(eigenvalue + shrinkage * mean eigenvalue)`` (``shrinkage`` keeps directions of
almost no variance, such as float16 rounding noise, from being blown up). It is linear, so a linear head on
whitened vectors could be the same function as one on raw vectors: whitening changes how fast it is found,
not what can be found (with ``K < D`` it also drops the weakest directions).

``whitening.safetensors`` (``mean`` and ``projection``, float32) sits in the shard set's root; the manifest's
feature record names it with its sha256 (``WhiteningRecord``), so an image searched later is whitened with the
very same map. This module is numbers and files only: no model, no loss.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddp_rank.data.format.manifest import join_location, read_location

__all__ = [
    "WHITENING_FILE",
    "Whitening",
    "WhiteningError",
    "WhiteningRecord",
    "fit_whitening",
    "load_whitening",
    "parse_whitening",
]

WHITENING_FILE = "whitening.safetensors"
"""The map's file, in the root of the whitened shard set."""


RANK_TOLERANCE = 1e-9
"""An axis whose variance (plus shrinkage) is below this share of the largest is taken as no variance at all."""


class WhiteningError(ValueError):
    """The whitening cannot be fitted, or its file does not match its record (the message names the fix)."""


@dataclass(frozen=True)
class WhiteningRecord:
    """Under the feature record (``build.features.whitening``): which map whitened the vectors."""

    file: str
    """The map's file name, relative to the shard set's root."""
    sha256: str
    """sha256 of that file's bytes."""
    input_dim: int
    """D: the backbone's vector length, before whitening (the record's ``dim`` is K, after)."""
    fitted_on: str
    """The split whose vectors gave the mean and covariance (the training split: never the test split)."""
    shrinkage: float
    """Added to each eigenvalue, times the mean eigenvalue, before the division."""
    source: str
    """The feature shard set that was whitened."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: Any, where: str) -> WhiteningRecord:
        """Parse and check; ``where`` names the record in errors."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} is a {type(raw).__name__}, not an object")
        for name in ("file", "sha256", "fitted_on", "source"):
            if not isinstance(raw.get(name), str) or not raw[name]:
                raise ValueError(f"{where}.{name} is missing or not a non-empty text")
        if "/" in raw["file"] or "\\" in raw["file"] or raw["file"] in (".", ".."):
            raise ValueError(f"{where}.file={raw['file']!r} must be a file name in the shard set's root")
        dim = raw.get("input_dim")
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"{where}.input_dim must be a positive integer, got {dim!r}")
        shrinkage = raw.get("shrinkage")
        if not isinstance(shrinkage, (int, float)) or isinstance(shrinkage, bool) or not shrinkage >= 0:
            raise ValueError(f"{where}.shrinkage must be a number >= 0, got {shrinkage!r}")
        unknown = sorted(set(raw) - {f for f in cls.__dataclass_fields__})
        if unknown:
            raise ValueError(f"{where} has unknown field(s) {', '.join(unknown)}")
        return cls(raw["file"], raw["sha256"], dim, raw["fitted_on"], float(shrinkage), raw["source"])


@dataclass(frozen=True)
class Whitening:
    """``w = (v - mean) @ projection``."""

    mean: np.ndarray
    """``[D]`` float32."""
    projection: np.ndarray
    """``[D, K]`` float32."""

    @property
    def input_dim(self) -> int:
        return int(self.projection.shape[0])

    @property
    def dim(self) -> int:
        return int(self.projection.shape[1])

    def apply(self, vectors: np.ndarray) -> np.ndarray:
        """``[n, D]`` vectors to ``[n, K]`` float32 whitened ones."""
        return (np.asarray(vectors, dtype=np.float32) - self.mean) @ self.projection

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the file (temporary name, then rename) and return the sha256 of its bytes."""
        from safetensors.numpy import save

        data = save({"mean": self.mean, "projection": np.ascontiguousarray(self.projection)})
        path = Path(path)
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
        return hashlib.sha256(data).hexdigest()


def fit_whitening(
    batches: Iterable[np.ndarray], dim: int | None = None, shrinkage: float = 1e-4
) -> tuple[Whitening, np.ndarray]:
    """The whitening of the vectors in ``batches`` (each ``[n, D]``), keeping ``dim`` axes (all when None);
    returns it with the covariance's eigenvalues, largest first.

    The covariance is summed in float64 around the first batch's mean (no cancellation from a large common
    offset), one batch at a time: memory is ``D x D``, whatever the number of vectors."""
    if shrinkage < 0:
        raise WhiteningError(f"shrinkage must be >= 0, got {shrinkage}")
    total, count, shift, products = None, 0, None, None
    for batch in batches:
        x = torch.from_numpy(np.asarray(batch, dtype=np.float64))
        if x.ndim != 2 or x.shape[0] == 0:
            continue
        if shift is None:
            shift = x.mean(0)
            total = torch.zeros_like(shift)
            products = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64)
        assert total is not None and products is not None
        centred = x - shift
        total += centred.sum(0)
        products += centred.T @ centred
        count += x.shape[0]
    if shift is None or total is None or products is None or count < 2:
        raise WhiteningError(f"whitening needs at least 2 vectors, got {count}")
    width = products.shape[0]
    dim = width if dim is None else dim
    if not 1 <= dim <= width:
        raise WhiteningError(f"--dim must be between 1 and the vectors' length {width}, got {dim}")
    offset = total / count
    covariance = (products - count * torch.outer(offset, offset)) / (count - 1)
    eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
    eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
    scale = eigenvalues[:dim] + shrinkage * eigenvalues.clamp(min=0).mean()
    # An axis of no variance (values that are sums of others) comes out of eigh as rounding noise around 0:
    # dividing by its root would blow that noise up to unit variance.
    floor = float(eigenvalues[0]) * RANK_TOLERANCE
    if not bool((scale > floor).all()):
        rank = int((eigenvalues > floor).sum())
        raise WhiteningError(
            f"the vectors span only about {rank} of their {width} dimensions: pass --dim {rank} or less, or a "
            "--shrinkage above 0"
        )
    # Each axis's sign fixed (largest entry positive): eigh may return either, and a rebuild should match.
    signs = torch.sign(eigenvectors[eigenvectors.abs().argmax(0), torch.arange(width)])
    eigenvectors = eigenvectors * torch.where(signs == 0, 1.0, signs)
    projection = eigenvectors[:, :dim] / scale.sqrt()
    whitening = Whitening((shift + offset).float().numpy(), projection.float().numpy())
    return whitening, eigenvalues.numpy()


def load_whitening(root: str, record: WhiteningRecord) -> Whitening:
    """The map a shard set's record names, read from ``root`` (a directory or a URL) and checked against the
    record's sha256 and input dimension; ``WhiteningError`` naming the file and the fix otherwise."""
    path = join_location(root, record.file)
    try:
        data = read_location(path)
    except OSError as exc:
        raise WhiteningError(
            f"{path}: cannot be read ({exc.strerror or exc}); the vectors of {root} were whitened with it: "
            "restore it, or whiten the feature shards again (`ddp-rank shards whiten`)"
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.sha256:
        raise WhiteningError(
            f"{path}: sha256 {digest[:12]}... is not the {record.sha256[:12]}... the manifest records: the file "
            "was changed or damaged; restore it, or whiten the feature shards again"
        )
    return parse_whitening(data, record.input_dim, path)


def parse_whitening(data: bytes, input_dim: int, where: str) -> Whitening:
    """The map in ``data`` (a ``whitening.safetensors`` file's bytes, from ``where``), which must take vectors of
    ``input_dim`` values; ``WhiteningError`` else."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        tensors = load(data)
        mean, projection = tensors["mean"], tensors["projection"]
    except (SafetensorError, KeyError) as exc:  # only a file written by another tool can get here
        raise WhiteningError(f"{where}: not a whitening map ({exc})") from exc
    if mean.shape != (input_dim,) or projection.ndim != 2 or projection.shape[0] != input_dim:
        raise WhiteningError(
            f"{where}: shapes {mean.shape} and {projection.shape} do not take vectors of {input_dim} values"
        )
    return Whitening(mean.astype(np.float32), projection.astype(np.float32))
