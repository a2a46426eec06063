"""Checks of a loss's inputs and hyper-parameters: every refusal names the problem and the way out."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ddp_rank.losses.rows import compute_dtype

# How far from 1 a row norm may be when ``normalize=False`` promises unit rows.
_UNIT_NORM_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2}
_DEFAULT_UNIT_NORM_TOLERANCE = 1e-3


def check_positive(name: str, value: float) -> float:
    """A hyper-parameter that must be a finite positive number (temperatures, slopes, exponents)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def check_labels(labels: Tensor) -> Tensor:
    """Labels must be a 1-D integer tensor; returned as int64."""
    if not isinstance(labels, Tensor):
        raise ValueError(f"labels must be a torch.Tensor of integer class ids, got {type(labels).__name__}")
    if labels.dim() != 1:
        raise ValueError(f"labels must be 1-D [N], got shape {tuple(labels.shape)}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"labels must be integer class ids (int64), got dtype {labels.dtype}; convert with labels.long() "
            "after checking they hold whole numbers"
        )
    return labels.long()


def check_embeddings(embeddings: Tensor, expected_rows: int) -> None:
    """Embeddings must be a finite floating ``[N, d]`` tensor with one row per label."""
    if not isinstance(embeddings, Tensor):
        raise ValueError(f"embeddings must be a torch.Tensor, got {type(embeddings).__name__}")
    if embeddings.dim() != 2:
        raise ValueError(f"embeddings must be 2-D [N, d], got shape {tuple(embeddings.shape)}")
    if not embeddings.is_floating_point():
        raise ValueError(f"embeddings must be floating point, got dtype {embeddings.dtype}")
    if embeddings.shape[0] != expected_rows:
        raise ValueError(
            f"embeddings have {embeddings.shape[0]} rows but labels have {expected_rows}: one label per row"
        )
    finite = torch.isfinite(embeddings.detach()).all(dim=1)
    if not bool(finite.all()):
        bad = torch.nonzero(~finite).flatten()[:5].tolist()
        raise ValueError(
            f"embeddings contain NaN or Inf (rows {bad}{'...' if (~finite).sum() > 5 else ''}); "
            "the network diverged or its input is broken (lower the learning rate, check the data)"
        )


def check_norms_fit(embeddings: Tensor) -> None:
    """Finite rows whose squared length overflows the compute dtype (a float32 norm above ~1.8e19) would be
    normalised to zero rows and train on silently; they only come from a diverged network."""
    if not embeddings.shape[0]:
        return
    norms = torch.linalg.vector_norm(embeddings.detach().to(compute_dtype(embeddings.dtype)), dim=1)
    if not bool(torch.isfinite(norms).all()):
        worst = int(torch.nonzero(~torch.isfinite(norms))[0])
        raise ValueError(
            f"embedding row {worst} is too long to normalise in {norms.dtype} (its squared norm overflows); "
            "the network diverged (lower the learning rate, check the data)"
        )


def check_unit_rows(x: Tensor, input_dtype: torch.dtype) -> None:
    """With ``normalize=False`` the caller promises unit rows; a row further from norm 1 than its input dtype's
    rounding explains is refused."""
    if not x.shape[0]:
        return
    norms = x.detach().norm(dim=1)
    tolerance = _UNIT_NORM_TOLERANCE.get(input_dtype, _DEFAULT_UNIT_NORM_TOLERANCE)
    worst = int((norms - 1).abs().argmax())
    if abs(float(norms[worst]) - 1) > tolerance:
        raise ValueError(
            f"normalize=False needs unit-length embedding rows, but row {worst} has norm "
            f"{float(norms[worst]):.4g}; L2-normalise the embeddings or use normalize=True"
        )


def check_rows_inputs(queries: Tensor, query_index: Tensor, database: Tensor, labels: Tensor) -> None:
    """The arguments of ``ListwiseLoss.rows``: matching widths, int64 indices and labels, indices in range."""
    if queries.dim() != 2 or database.dim() != 2 or queries.shape[1] != database.shape[1]:
        raise ValueError(
            f"queries [q, d] and database [N, d] must share d, got {tuple(queries.shape)} and "
            f"{tuple(database.shape)}"
        )
    if query_index.shape != (queries.shape[0],) or query_index.dtype != torch.int64:
        raise ValueError(
            f"query_index must be int64 of shape [{queries.shape[0]}], got {query_index.dtype} "
            f"{tuple(query_index.shape)}"
        )
    if labels.shape != (database.shape[0],) or labels.dtype != torch.int64:
        raise ValueError(
            f"database_labels must be int64 of shape [{database.shape[0]}], got {labels.dtype} "
            f"{tuple(labels.shape)}"
        )
    # One read on the host for both ends (each is a device sync on a GPU).
    if query_index.numel() and bool(((query_index < 0) | (query_index >= database.shape[0])).any()):
        raise ValueError("query_index points outside the database")
