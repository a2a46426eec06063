"""A difference between two trained points, with the test set's own noise: a paired bootstrap over its classes.

A point (a setting: a batch size, a loss) is trained with a few seeds and each run is evaluated once on the test
split, which writes every query's own values (``ddp-rank eval --per-query``: a hit at k, AP@R, the query's class).
The difference of two points has two sources of noise:

- **training**: another seed gives another network. ``intervals.paired_t_interval`` over the per-seed differences
  measures it (seed i of one point against seed i of the other).
- **the test set**: its classes are one draw of the population; another draw of the same size would rank the two
  points by another margin. A bootstrap measures it: draw the test classes with replacement (each with all of its
  queries: queries of one class share their relevant items, so resampling single queries would understate the
  spread), apply the SAME draw to both points and to every seed, take the mean over the drawn queries of each
  seed's per-query difference and average over the seeds. Pairing the draw cancels what the two points share
  (the same hard classes are hard for both), which is why such a difference is far tighter than either figure's
  own interval.

``compare_points`` gives both, and a combined interval: the two are independent (the seeds are scored on one test
set, so their spread is the training's; the class draw is the test set's), so their variances add; the
seeds' variance is estimated from 3 values and the classes' from thousands, and the Welch-Satterthwaite degrees of
freedom of the sum set its t quantile (``intervals.combined_interval``). A difference is beyond noise only where the
combined interval excludes zero, else "within noise". (The seeds' interaction with the test classes enters both
variances, so the combination is slightly conservative.) ``point_interval`` gives one point's own mean the same way
(for a plot's error bars: it keeps the noise that pairing cancels).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddp_rank.experiments.intervals import (
    CONFIDENCE,
    Interval,
    VarianceTerm,
    combined_interval,
    paired_t_interval,
)

__all__ = [
    "PointDifference",
    "QueryValues",
    "class_bootstrap",
    "compare_points",
    "load_query_values",
    "point_interval",
]

RESAMPLES = 2000
"""Class draws of a bootstrap: enough that the 2.5th and 97.5th percentiles move by a small fraction of the
interval's width between bootstrap seeds."""


@dataclass(frozen=True)
class QueryValues:
    """One run's per-query values on one test split: ``values[metric]`` (float [n]) and each query's class
    (``labels``, int [n]), in the order ``ddp-rank eval`` scored them; ``keys`` names the queries (checked
    equal across the runs compared, so that query i is the same image in each)."""

    values: dict[str, np.ndarray]
    labels: np.ndarray
    keys: np.ndarray | None = None


def load_query_values(path: str | os.PathLike[str]) -> QueryValues:
    """The per-query file ``ddp-rank eval --per-query PATH`` writes (an ``.npz``: one array per metric, ``label``
    and ``key``)."""
    with np.load(path, allow_pickle=False) as data:
        arrays = {name: data[name] for name in data.files}
    if "label" not in arrays:
        raise ValueError(f"{path}: no 'label' array: not a file of `ddp-rank eval --per-query`")
    labels = arrays.pop("label")
    keys = arrays.pop("key", None)
    return QueryValues({name: np.asarray(v, dtype=np.float64) for name, v in arrays.items()}, labels, keys)


def _check_same_queries(runs: Sequence[QueryValues], metric: str) -> None:
    first = runs[0]
    for i, run in enumerate(runs):
        if metric not in run.values:
            raise ValueError(f"run {i} has no per-query {metric!r}; it has {sorted(run.values)}")
        if not np.array_equal(run.labels, first.labels):
            raise ValueError(
                f"run {i} scored other queries than run 0 ({len(run.labels)} against {len(first.labels)} labels, "
                "or another order): compare runs evaluated on the same split of the same shards"
            )
        if run.keys is not None and first.keys is not None and not np.array_equal(run.keys, first.keys):
            raise ValueError(f"run {i}'s queries are other images than run 0's (their keys differ)")


def class_draws(
    per_query: np.ndarray, labels: np.ndarray, resamples: int = RESAMPLES, seed: int = 0
) -> np.ndarray:
    """The mean of ``per_query`` over each of ``resamples`` draws of the classes of ``labels`` with replacement
    (each drawn class brings all its queries; the mean is over the queries drawn, so a draw of larger classes weighs
    them as the test set would)."""
    classes, index = np.unique(labels, return_inverse=True)
    sums = np.bincount(index, weights=per_query, minlength=len(classes))
    counts = np.bincount(index, minlength=len(classes)).astype(np.float64)
    rng = np.random.default_rng(seed)
    stats = np.empty(resamples)
    block = max(1, (1 << 24) // max(1, len(classes)))  # draws held at once: at most 16 M class counts
    for start in range(0, resamples, block):
        size = min(block, resamples - start)
        drawn = rng.multinomial(len(classes), np.full(len(classes), 1.0 / len(classes)), size=size)
        stats[start : start + size] = (drawn @ sums) / (drawn @ counts)
    return stats


def class_bootstrap(
    per_query: np.ndarray,
    labels: np.ndarray,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> tuple[float, float, float]:
    """The mean of ``per_query`` and the percentile ``confidence`` interval of that mean over ``class_draws``."""
    stats = class_draws(per_query, labels, resamples, seed)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(per_query.mean()), float(low), float(high)


@dataclass(frozen=True)
class PointDifference:
    """``a - b`` of one metric (fractions, as the metrics are): over the test classes (``queries``: the percentile
    interval of the paired class bootstrap of the seed-averaged per-query difference, ``count`` its classes) and
    over the seeds (``seeds``: paired t; None under two seeds); ``terms`` the two variances of the mean that
    ``interval`` combines."""

    metric: str
    queries: Interval
    seeds: Interval | None
    terms: tuple[VarianceTerm, ...] = ()

    @property
    def mean(self) -> float:
        return self.queries.mean

    def interval(self, confidence: float = CONFIDENCE) -> Interval | None:
        """The seeds' and the test classes' noise combined (Welch-Satterthwaite) at ``confidence`` (None under two
        seeds: one seed says nothing of the training's noise)."""
        if self.seeds is None:
            return None
        return combined_interval(self.mean, self.terms, self.seeds.count, confidence)

    @property
    def combined(self) -> Interval | None:
        return self.interval(self.queries.confidence)

    @property
    def beyond_noise(self) -> bool:
        """The combined interval excludes zero."""
        combined = self.combined
        return combined is not None and not combined.within_noise

    @property
    def verdict(self) -> str:
        if not self.beyond_noise:
            return "within noise"
        return "higher" if self.mean > 0 else "lower"


def _terms(
    per_seed: list[np.ndarray], labels: np.ndarray, resamples: int, seed: int
) -> tuple[np.ndarray, np.ndarray, tuple[VarianceTerm, ...]]:
    """The seed-averaged per-query values, their class draws, and the variance of their mean over the seeds and over
    the test classes (with its degrees of freedom)."""
    averaged = np.mean(per_seed, axis=0)
    draws = class_draws(averaged, labels, resamples, seed)
    n_seeds, n_classes = len(per_seed), len(np.unique(labels))
    seed_var = float(np.var([d.mean() for d in per_seed], ddof=1) / n_seeds) if n_seeds > 1 else 0.0
    terms = (
        VarianceTerm(seed_var, max(1, n_seeds - 1)),
        VarianceTerm(float(np.var(draws, ddof=1)), n_classes - 1),
    )
    return averaged, draws, terms


def compare_points(
    a: Sequence[QueryValues],
    b: Sequence[QueryValues],
    metric: str,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> PointDifference:
    """``a - b`` for ``metric``: seed i of ``a`` is paired with seed i of ``b``; every run must have scored the same
    queries in the same order."""
    if not a or len(a) != len(b):
        raise ValueError(
            f"compare_points pairs seed i of one point with seed i of the other: give both the same number of runs, "
            f"at least one (got {len(a)} and {len(b)})"
        )
    pairs = list(zip(a, b, strict=True))
    _check_same_queries([run for pair in pairs for run in pair], metric)
    per_seed = [x.values[metric] - y.values[metric] for x, y in pairs]
    labels = pairs[0][0].labels
    averaged, draws, terms = _terms(per_seed, labels, resamples, seed)
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(draws, [tail, 100 - tail])
    seeds = paired_t_interval([float(d.mean()) for d in per_seed], confidence)
    queries = Interval(float(averaged.mean()), float(low), float(high), len(np.unique(labels)), confidence)
    return PointDifference(metric, queries, seeds, terms)


def point_interval(
    runs: Sequence[QueryValues],
    metric: str,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> Interval | None:
    """One point's mean ``metric`` over its seeds, with the seeds' and the test classes' noise combined as in
    ``compare_points`` (None under two seeds)."""
    if len(runs) < 2:
        return None
    _check_same_queries(runs, metric)
    averaged, _, terms = _terms([r.values[metric] for r in runs], runs[0].labels, resamples, seed)
    return combined_interval(float(averaged.mean()), terms, len(runs), confidence)
