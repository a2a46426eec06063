"""Verification (1:1) over every pair of a test split: TPR@FPR, ROC AUC, EER, average precision, and the curves.

Verification answers "are these two images of the same identity?": a pair is accepted when its score (the inner
product of the two embeddings) reaches a threshold. Over the N(N-1)/2 unordered pairs of the split (positive: same
label; negative: different labels), a threshold gives a true positive rate (accepted positives) and a false
positive rate (accepted negatives). Definitions, the same as scikit-learn's on the same scores:

- ``tpr@fpr=f``: the highest TPR among thresholds whose FPR is at most ``f``, read off the ROC curve's points
  (no interpolation). Measurable only when the split has at least ``1/f`` negative pairs (1e-4 needs 10,000);
  otherwise None, never extrapolated.
- ``roc_auc``: the area under the ROC curve: the probability that a positive pair scores above a negative one,
  a tie counting one half (``roc_auc_score``).
- ``eer``: the equal error rate, where the ROC curve (straight lines between its points) crosses FNR = FPR.
- ``pr_auc``: average precision over the pairs, the sum over thresholds of the recall step times the precision
  (``average_precision_score``; no interpolation).

Exact without the N^2 scores. The ROC and PR curves only bend at the scores of positive pairs: once we know, for
each distinct positive score u, how many negative pairs score above u and how many equal it, every figure above
is exact. The positive pairs are few (the sum over classes of n_c(n_c - 1)/2: linear in N when classes are
bounded), so their scores are kept, sorted. The negative pairs are scored in blocks of rows (at most
``block_bytes`` of work space) and only counted into the gaps between consecutive positive scores
(``np.searchsorted``), then dropped. Memory O(P + block), time O(N^2 (d + log P)). A split whose classes are so
large that the positive pairs themselves would not fit (more than ``max_positive_pairs``) is refused with an
error, rather than approximated by a histogram.

Pure numpy, so ``tracemalloc`` sees every allocation (the memory-bound test relies on it).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_FPRS",
    "DEFAULT_MAX_POSITIVE_PAIRS",
    "PairCounts",
    "count_pairs",
    "figures_from_counts",
    "fpr_key",
    "verification_metrics",
]

DEFAULT_FPRS: tuple[float, ...] = (1e-2, 1e-3, 1e-4)
DEFAULT_BLOCK_BYTES = 256 << 20
"""Work space of one block of pair scores (the scores, the mask, the bin of each score)."""
DEFAULT_MAX_POSITIVE_PAIRS = 1 << 24
"""Most positive pairs kept (about 28 bytes each): 16.8 M, e.g. 100,000 images in classes of up to 300."""
BYTES_PER_SCORE = 48
"""Work space per scored pair in a block (the score, its mask, its copy, its grid cell, its bin, the checks),
measured with tracemalloc."""
CURVE_POINTS = 400
"""Most points of a curve kept for the pictures (all of them exact points of the curve)."""


def fpr_key(prefix: str, rate: float) -> str:
    """``fpr_key("tpr@fpr", 0.001)`` -> ``"tpr@fpr=1e-3"``: the metric name of one operating point."""
    mantissa, exponent = f"{rate:.6e}".split("e")
    return f"{prefix}={mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


@dataclass(frozen=True)
class PairCounts:
    """What the verification figures need, per distinct positive score ``u`` (descending):

    ``pos_ge[i]``: positive pairs scoring >= u[i]; ``neg_gt[i]`` / ``neg_ge[i]``: negative pairs scoring > / >=
    u[i]; ``num_pos`` / ``num_neg``: all positive / negative pairs.
    """

    u: np.ndarray
    pos_ge: np.ndarray
    neg_gt: np.ndarray
    neg_ge: np.ndarray
    num_pos: float
    num_neg: float


def _row_blocks(rows: int, cols: int, block_bytes: int) -> Iterator[tuple[int, int]]:
    step = max(1, block_bytes // (BYTES_PER_SCORE * max(cols, 1)))
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _upper_scores(e: np.ndarray, start: int, stop: int, keep: np.ndarray | None = None) -> np.ndarray:
    """Scores of the pairs (i, j), start <= i < stop, j > i, where ``keep`` [stop-start, N-start] is True."""
    s = e[start:stop] @ e[start:].T  # [b, N - start]
    upper = np.ones(s.shape, dtype=bool) if keep is None else keep
    b = stop - start
    upper[:, :b] &= np.triu(np.ones((b, b), dtype=bool), k=1)
    return s[upper]


class _SortedLookup:
    """``np.searchsorted(u, v, side="right")`` for many ``v``, about four times faster (measured in CPU time): a
    uniform grid over u's range (16 cells per value of u, at most 2^20) guesses each answer from a table (exact
    when no value of u lies in the grid cell of v), every guess is checked (u[r-1] <= v < u[r]), and only the
    values that fail go through the binary search."""

    MAX_CELLS = 1 << 20
    CELLS_PER_VALUE = 16

    def __init__(self, u: np.ndarray) -> None:
        self.u = u
        self.CELLS = min(self.MAX_CELLS, max(1024, self.CELLS_PER_VALUE * len(u)))
        self.padded = np.concatenate([[-np.inf], u, [np.inf]]).astype(u.dtype)  # padded[r] = u[r - 1]
        if len(u):
            self.lo, span = u[0], u[-1] - u[0]
            self.scale = np.float32((self.CELLS - 1) / span if span > 0 else 0.0)
            edges = self.lo + np.arange(self.CELLS, dtype=np.float64) / (float(self.scale) or 1.0)
            # table[0]: below u's range; table[k + 1]: the grid cell k.
            self.table = np.concatenate([[0], np.searchsorted(u, edges, side="right")]).astype(np.int32)

    def count_at_or_below(self, v: np.ndarray) -> np.ndarray:
        if not len(self.u):
            return np.zeros(len(v), dtype=np.int64)
        cell = v - self.lo
        cell *= self.scale
        cell += 1
        np.clip(cell, 0, self.CELLS, out=cell)
        r = self.table.take(cell.astype(np.int32)).astype(np.int64)
        wrong = self.padded.take(r) > v
        wrong |= self.padded.take(r + 1) <= v
        if wrong.any():
            r[wrong] = np.searchsorted(self.u, v[wrong], side="right")
        return r


def count_pairs(
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_positive_pairs: int = DEFAULT_MAX_POSITIVE_PAIRS,
) -> PairCounts:
    """Score every unordered pair of ``embeddings [N, d]`` once and count them as :class:`PairCounts`.

    Raises ValueError when the positive pairs exceed ``max_positive_pairs`` (the message says how many).
    """
    e = np.ascontiguousarray(embeddings, dtype=np.float32)
    y = np.asarray(labels, dtype=np.int64)
    n = len(y)
    sizes = np.unique(y, return_counts=True)[1]
    num_pos = int((sizes * (sizes - 1) // 2).sum())
    if num_pos > max_positive_pairs:
        raise ValueError(
            f"verification: the split has {num_pos:,} positive pairs (classes of up to {int(sizes.max()):,} "
            f"images), more than eval.max_positive_pairs={max_positive_pairs:,}; raise it (about 28 bytes a pair) "
            "or evaluate a split with smaller classes"
        )
    num_neg = n * (n - 1) // 2 - num_pos
    # Positive scores: the classes one by one (rows of a class are contiguous after a stable sort by label).
    order = np.argsort(y, kind="stable")
    ends = np.cumsum(sizes)
    positives = []
    for size, end in zip(sizes, ends, strict=True):
        if size < 2:
            continue
        members = e[order[end - size : end]]
        for start, stop in _row_blocks(int(size), int(size), block_bytes):
            positives.append(_upper_scores(members, start, stop))
    u_asc, multiplicity = np.unique(
        np.concatenate(positives) if positives else np.empty(0, np.float32), return_counts=True
    )
    # Negative scores: blocks of rows against the rows after them, counted into the gaps between positive scores.
    gaps = np.zeros(len(u_asc) + 1, dtype=np.int64)  # gaps[g]: negatives above exactly g positive scores
    ties = np.zeros(len(u_asc), dtype=np.int64)  # ties[j]: negatives equal to u_asc[j]
    counted = 0
    lookup = _SortedLookup(u_asc)
    for start, stop in _row_blocks(n, n, block_bytes):
        s = _upper_scores(e, start, stop, y[start:stop, None] != y[None, start:])
        counted += len(s)
        if not len(u_asc):
            continue
        at_or_below = lookup.count_at_or_below(s)  # u_asc[:r] <= s
        equal = at_or_below > 0
        equal[equal] = u_asc[at_or_below[equal] - 1] == s[equal]
        gaps += np.bincount(at_or_below - equal, minlength=len(u_asc) + 1)
        ties += np.bincount(at_or_below[equal] - 1, minlength=len(u_asc))
    assert counted == num_neg, (counted, num_neg)
    # neg_gt for u_asc[j]: negatives above more than j positive scores.
    neg_gt_asc = np.cumsum(gaps[::-1])[::-1][1:] if len(u_asc) else np.empty(0, np.int64)
    neg_ge_asc = neg_gt_asc + ties
    return PairCounts(
        u=u_asc[::-1].astype(np.float64),
        pos_ge=np.cumsum(multiplicity[::-1]),
        neg_gt=neg_gt_asc[::-1].copy(),
        neg_ge=neg_ge_asc[::-1].copy(),
        num_pos=num_pos,
        num_neg=int(num_neg),
    )


def roc_points(c: PairCounts) -> tuple[np.ndarray, np.ndarray]:
    """(false positive counts, true positive counts) of the ROC curve's points, from (0, 0) to (N-, P): at each
    distinct positive score, first the negatives above it (a horizontal step), then the pairs at it."""
    prev_pos = np.concatenate([[0], c.pos_ge[:-1]])
    fp = np.stack([c.neg_gt, c.neg_ge], axis=1).reshape(-1)
    tp = np.stack([prev_pos, c.pos_ge], axis=1).reshape(-1)
    return (
        np.concatenate([[0], fp, [c.num_neg]]).astype(np.float64),
        np.concatenate([[0], tp, [c.num_pos]]).astype(np.float64),
    )


def _tpr_at_fpr(c: PairCounts, rate: float) -> float | None:
    if c.num_pos == 0 or c.num_neg * rate < 1 - 1e-9:
        return None
    allowed = math.floor(c.num_neg * rate + 1e-9)
    within = int(np.searchsorted(c.neg_ge, allowed, side="right"))  # neg_ge is non-decreasing
    return float(c.pos_ge[within - 1]) / c.num_pos if within else 0.0


def _eer(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """FPR where the polyline through the ROC points crosses FNR = FPR."""
    gap = (1.0 - tpr) - fpr  # FNR - FPR: +1 at (0, 0), -1 at (1, 1), non-increasing
    k = int(np.argmax(gap <= 0))
    if gap[k] == 0:
        return float(fpr[k])
    t = gap[k - 1] / (gap[k - 1] - gap[k])
    return float(fpr[k - 1] + t * (fpr[k] - fpr[k - 1]))


def _thin(x: np.ndarray, log_x: bool) -> np.ndarray:
    """Indices of at most about CURVE_POINTS points of a curve sorted by ``x``: the first, the last and, for each
    value of a grid over ``x`` (log-spaced too where the low end matters), the last point at or below it."""
    if len(x) <= CURVE_POINTS:
        return np.arange(len(x))
    grid = [np.linspace(x[0], x[-1], CURVE_POINTS // 2)]
    positive = x[x > 0]
    if log_x and len(positive):
        grid.append(np.geomspace(positive[0], x[-1], CURVE_POINTS // 2))
    picks = np.searchsorted(x, np.concatenate(grid), side="right") - 1
    return np.unique(np.concatenate([[0, len(x) - 1], picks.clip(0, len(x) - 1)]))


def verification_metrics(
    embeddings: np.ndarray,
    labels: np.ndarray,
    fprs: Sequence[float] = DEFAULT_FPRS,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    max_positive_pairs: int = DEFAULT_MAX_POSITIVE_PAIRS,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, curves) of verification over every pair of the split (see the module doc for each figure).

    Metrics: ``tpr@fpr=<f>`` for each ``f`` (None where not measurable), ``roc_auc``, ``eer``, ``pr_auc`` (None
    without a positive or a negative pair), ``num_positive_pairs``, ``num_negative_pairs``. Curves: ``roc``
    (``fpr``, ``tpr``, with the operating points), ``pr`` (``recall``, ``precision``), at most about 400 exact
    points each, or empty when undefined.
    """
    c = count_pairs(embeddings, labels, block_bytes=block_bytes, max_positive_pairs=max_positive_pairs)
    return figures_from_counts(c, fprs)


def figures_from_counts(
    c: PairCounts, fprs: Sequence[float] = DEFAULT_FPRS
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, curves) of :func:`verification_metrics` from the pair counts alone. The counts may be weights
    (floats: the identity bootstrap, ``ddp_rank.eval.identity_bootstrap``, counts a pair as often as both of its
    identities were drawn)."""
    metrics: dict[str, Any] = {fpr_key("tpr@fpr", f): _tpr_at_fpr(c, f) for f in fprs}
    curves: dict[str, Any] = {}
    if c.num_pos and c.num_neg:
        fp, tp = roc_points(c)
        fpr, tpr = fp / c.num_neg, tp / c.num_pos
        metrics["roc_auc"] = float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2))
        metrics["eer"] = _eer(fpr, tpr)
        recall = c.pos_ge / c.num_pos
        precision = c.pos_ge / (c.pos_ge + c.neg_ge)
        metrics["pr_auc"] = float(np.sum(np.diff(recall, prepend=0.0) * precision))
        keep = _thin(fpr, log_x=True)
        points = {k: v for k, v in metrics.items() if k.startswith("tpr@fpr=") and v is not None}
        curves["roc"] = {
            "fpr": fpr[keep].tolist(),
            "tpr": tpr[keep].tolist(),
            "operating_points": {k: [float(k.split("=")[1]), v] for k, v in points.items()},
            "eer": metrics["eer"],
        }
        keep = _thin(recall, log_x=False)
        curves["pr"] = {"recall": recall[keep].tolist(), "precision": precision[keep].tolist()}
    else:
        metrics.update(roc_auc=None, eer=None, pr_auc=None)
    metrics["num_positive_pairs"] = c.num_pos
    metrics["num_negative_pairs"] = c.num_neg
    return metrics, curves
