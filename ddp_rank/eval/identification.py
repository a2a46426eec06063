"""Identification (1:N): closed-set CMC and open-set FNIR@FPIR against an enrolled gallery.

The split of the test set, seeded and the same for any world size (the rows arrive sorted by sample key):

1. The identities (labels) are shuffled with ``seed``; the first ``round(enrolled_fraction * identities)`` are
   enrolled, the others are not (at least one of each when the fraction is strictly between 0 and 1).
2. Each enrolled identity puts ``gallery_per_identity`` of its images, drawn at random, into the gallery (1 by
   default, as a deployment enrols one photo per person; 0 = all of its images but one). Its other images are
   *mated* probes: their identity is in the gallery.
3. Every image of a non-enrolled identity is a *non-mated* probe (a stranger, or someone not on the deny list).

Figures (ISO/IEC 19795-1 and NIST FRVT naming):

- ``cmc@r`` (closed set, Recall@Rank): the share of mated probes whose identity ranks r or better, identities
  ranked by their best-scoring gallery image. A tie is not a win: an identity scoring as high as the right one
  ranks ahead of it.
- ``fnir@fpir=f`` (open set): the threshold t is the lowest that lets at most a share f of the non-mated probes
  through (their top score above t); FNIR is the share of mated probes NOT identified at rank 1 with a score
  above t. It depends on the gallery's size (more enrolled identities, more chances for a stranger to resemble
  one), so ``gallery_size`` and ``gallery_identities`` are reported with it. Measurable only with at least 1/f
  non-mated probes; None otherwise (an empty open set included), never extrapolated.

Probes are scored against the gallery in blocks of rows (``block_bytes``), so memory is linear in the split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddp_rank.eval.verification import DEFAULT_BLOCK_BYTES, fpr_key

__all__ = [
    "DEFAULT_FPIRS",
    "DEFAULT_RANKS",
    "IdentificationSplit",
    "ProbeOutcomes",
    "identification_figures",
    "identification_metrics",
    "identification_report",
    "probe_outcomes",
    "split_identities",
]

DEFAULT_FPIRS: tuple[float, ...] = (1e-1, 1e-2)
DEFAULT_RANKS: tuple[int, ...] = (1, 5, 10, 20)
BYTES_PER_SCORE = 24
"""Work space per probe-gallery score of a block: the score, the per-identity maxima, the comparison."""
CMC_POINTS = 100
"""Ranks of the CMC curve kept for the picture: every rank up to this one."""


@dataclass(frozen=True)
class IdentificationSplit:
    """Row indices of the gallery, the mated probes and the non-mated probes."""

    gallery: np.ndarray
    mated: np.ndarray
    non_mated: np.ndarray


def split_identities(
    labels: np.ndarray, enrolled_fraction: float = 0.5, gallery_per_identity: int = 1, seed: int = 0
) -> IdentificationSplit:
    """The seeded enrolled / non-enrolled split of the module doc."""
    y = np.asarray(labels, dtype=np.int64)
    rng = np.random.default_rng(seed)
    identities = rng.permutation(np.unique(y))
    enrolled_count = round(enrolled_fraction * len(identities))
    if 0 < enrolled_fraction < 1 and len(identities) >= 2:
        enrolled_count = min(max(enrolled_count, 1), len(identities) - 1)
    enrolled = set(identities[:enrolled_count].tolist())
    gallery, mated, non_mated = [], [], []
    for identity in identities.tolist():
        rows = np.flatnonzero(y == identity)
        if identity not in enrolled:
            non_mated.append(rows)
            continue
        rows = rng.permutation(rows)
        keep = gallery_per_identity if gallery_per_identity > 0 else max(len(rows) - 1, 1)
        gallery.append(rows[:keep])
        mated.append(rows[keep:])

    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.sort(np.concatenate(parts)) if parts else np.empty(0, dtype=np.int64)

    return IdentificationSplit(joined(gallery), joined(mated), joined(non_mated))


def _best_per_identity(
    e: np.ndarray, probes: np.ndarray, gallery: np.ndarray, starts: np.ndarray, block_bytes: int
) -> Any:
    """Yield (probe rows, [b, identities] best gallery score of each identity) block by block."""
    if not len(gallery):  # nothing enrolled (a split of one identity): no probe can be scored
        return
    step = max(1, block_bytes // (BYTES_PER_SCORE * max(len(gallery), 1)))
    g = e[gallery]
    for start in range(0, len(probes), step):
        rows = probes[start : start + step]
        yield rows, np.maximum.reduceat(e[rows] @ g.T, starts, axis=1)


@dataclass(frozen=True)
class ProbeOutcomes:
    """What every figure is computed from, per probe: the rank of a mated probe's identity and its score
    (``rank_of``, ``right_score``, in the order of ``split.mated``), a non-mated probe's top score (``top``, in
    the order of ``split.non_mated``), and the gallery's size. The identity bootstrap
    (``ddp_rank.eval.identity_bootstrap``) reweights the probes and recomputes the figures from these alone."""

    split: IdentificationSplit
    rank_of: np.ndarray
    right_score: np.ndarray
    top: np.ndarray
    gallery_size: int
    gallery_identities: int


def probe_outcomes(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    enrolled_fraction: float = 0.5,
    gallery_per_identity: int = 1,
    seed: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> ProbeOutcomes:
    """Score every probe of the seeded split against the gallery (in blocks of ``block_bytes``)."""
    e = np.ascontiguousarray(embeddings, dtype=np.float32)
    y = np.asarray(labels, dtype=np.int64)
    split = split_identities(y, enrolled_fraction, gallery_per_identity, seed)
    # Gallery columns grouped by identity, so a row's best score per identity is one reduceat.
    gallery = split.gallery[np.argsort(y[split.gallery], kind="stable")]
    identities, starts = np.unique(y[gallery], return_index=True)
    # Mated probes: the rank of the right identity, and whether it is identified at rank 1 with which score.
    rank_of = np.empty(len(split.mated), dtype=np.int64)
    right_score = np.empty(len(split.mated), dtype=np.float32)
    done = 0
    for rows, best in _best_per_identity(e, split.mated, gallery, starts, block_bytes):
        column = np.searchsorted(identities, y[rows])
        right = best[np.arange(len(rows)), column]
        rank_of[done : done + len(rows)] = (best >= right[:, None]).sum(1)  # ties rank ahead of the right one
        right_score[done : done + len(rows)] = right
        done += len(rows)
    # Non-mated probes: their top score against the gallery.
    top = np.concatenate(
        [best.max(1) for _, best in _best_per_identity(e, split.non_mated, gallery, starts, block_bytes)]
        or [np.empty(0, np.float32)]
    )
    return ProbeOutcomes(split, rank_of, right_score, top, len(gallery), len(identities))


def identification_figures(
    o: ProbeOutcomes,
    ranks: Sequence[int] = DEFAULT_RANKS,
    fpirs: Sequence[float] = DEFAULT_FPIRS,
    mated_weights: np.ndarray | None = None,
    non_mated_weights: np.ndarray | None = None,
) -> dict[str, Any]:
    """``cmc@r`` and ``fnir@fpir=<f>`` from the probes' outcomes; each probe counted ``*_weights`` times
    (default once: the figures of the module doc)."""
    w_mated = np.ones(len(o.rank_of)) if mated_weights is None else np.asarray(mated_weights, np.float64)
    w_non = np.ones(len(o.top)) if non_mated_weights is None else np.asarray(non_mated_weights, np.float64)
    mated_total, non_mated_total = float(w_mated.sum()), float(w_non.sum())
    metrics: dict[str, Any] = {}
    for r in sorted(set(ranks)):
        hit = float(w_mated[o.rank_of <= r].sum()) / mated_total if mated_total else None
        metrics[f"cmc@{r}"] = hit
    order = np.argsort(-o.top, kind="stable")
    top_desc, counted = o.top[order], np.cumsum(w_non[order])
    for f in fpirs:
        key = fpr_key("fnir@fpir", f)
        if not mated_total or non_mated_total * f < 1 - 1e-9:
            metrics[key] = None
            continue
        allowed = math.floor(non_mated_total * f + 1e-9)
        # The first probe, best first, past the ``allowed`` weight of non-mated probes: its score is the threshold.
        first_refused = int(np.searchsorted(counted, allowed, side="right"))
        threshold = (
            top_desc[first_refused] if first_refused < len(top_desc) else -np.inf
        )  # accept scores above it
        hits = (o.rank_of == 1) & (o.right_score > threshold)
        metrics[key] = 1.0 - float(w_mated[hits].sum()) / mated_total
    return metrics


def identification_metrics(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    ranks: Sequence[int] = DEFAULT_RANKS,
    fpirs: Sequence[float] = DEFAULT_FPIRS,
    enrolled_fraction: float = 0.5,
    gallery_per_identity: int = 1,
    seed: int = 0,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, curves) of identification on the seeded split (see the module doc).

    Metrics: ``cmc@r`` for each r (None without a mated probe), ``fnir@fpir=<f>`` for each f (None where not
    measurable), ``gallery_size``, ``gallery_identities``, ``num_mated_probes``, ``num_non_mated_probes``.
    Curves: ``cmc`` (``rank``, ``rate``, the gallery size).
    """
    o = probe_outcomes(
        embeddings,
        labels,
        enrolled_fraction=enrolled_fraction,
        gallery_per_identity=gallery_per_identity,
        seed=seed,
        block_bytes=block_bytes,
    )
    return identification_report(o, ranks, fpirs)


def identification_report(
    o: ProbeOutcomes, ranks: Sequence[int] = DEFAULT_RANKS, fpirs: Sequence[float] = DEFAULT_FPIRS
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, curves) of :func:`identification_metrics` from the probes' outcomes."""
    metrics = identification_figures(o, ranks, fpirs)
    metrics["gallery_size"] = o.gallery_size
    metrics["gallery_identities"] = o.gallery_identities
    metrics["num_mated_probes"] = len(o.split.mated)
    metrics["num_non_mated_probes"] = len(o.split.non_mated)
    curves: dict[str, Any] = {}
    if len(o.rank_of):
        shown = np.arange(1, min(o.gallery_identities, CMC_POINTS) + 1)
        curves["cmc"] = {
            "rank": shown.tolist(),
            "rate": [float((o.rank_of <= r).mean()) for r in shown],
            "gallery_size": o.gallery_size,
            "gallery_identities": o.gallery_identities,
        }
    return metrics, curves
