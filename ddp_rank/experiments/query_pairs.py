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

``compare_points`` gives both, and a combined interval: its half-width is the two half-widths added in quadrature
(the test set's draw and the training's noise are independent, so their variances add; the seed part keeps its t
quantile, which at 3 seeds makes the combination cautious). A difference is beyond noise only where the combined
interval excludes zero, else "within noise".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddp_rank.experiments.intervals import CONFIDENCE, Interval, paired_t_interval

__all__ = ["PointDifference", "QueryValues", "class_bootstrap", "compare_points", "load_query_values"]

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


def class_bootstrap(
    per_query: np.ndarray,
    labels: np.ndarray,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> tuple[float, float, float]:
    """The mean of ``per_query`` and the percentile ``confidence`` interval of that mean when the classes of
    ``labels`` are drawn with replacement (each drawn class brings all its queries; the mean is over the queries
    drawn, so a draw of larger classes weighs them as the test set would)."""
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
    tail = 100 * (1 - confidence) / 2
    low, high = np.percentile(stats, [tail, 100 - tail])
    return float(per_query.mean()), float(low), float(high)


@dataclass(frozen=True)
class PointDifference:
    """``a - b`` of one metric (fractions, as the metrics are): over the test classes (``queries``: the paired
    class bootstrap of the seed-averaged per-query difference; ``count`` is the number of classes) and over the
    seeds (``seeds``: paired t; None under two seeds)."""

    metric: str
    queries: Interval
    seeds: Interval | None

    @property
    def mean(self) -> float:
        return self.queries.mean

    @property
    def combined(self) -> Interval | None:
        """The test classes' and the seeds' half-widths added in quadrature around the mean (None under two
        seeds: one seed says nothing of the training's noise)."""
        if self.seeds is None:
            return None
        lows, highs = self.mean - self.queries.low, self.queries.high - self.mean
        seed_half = (self.seeds.high - self.seeds.low) / 2
        return Interval(self.mean, self.mean - (lows**2 + seed_half**2) ** 0.5,
                        self.mean + (highs**2 + seed_half**2) ** 0.5, self.seeds.count,
                        self.queries.confidence)  # fmt: skip

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


def compare_points(
    a: Sequence[QueryValues],
    b: Sequence[QueryValues],
    metric: str,
    resamples: int = RESAMPLES,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> PointDifference:
    """``a - b`` for ``metric``: seed i of ``a`` is paired with seed i of ``b`` (as many pairs as the shorter
    list); every run must have scored the same queries in the same order."""
    if not a or len(a) != len(b):
        raise ValueError(
            f"compare_points pairs seed i of one point with seed i of the other: give both the same number of runs, "
            f"at least one (got {len(a)} and {len(b)})"
        )
    pairs = list(zip(a, b, strict=True))
    _check_same_queries([run for pair in pairs for run in pair], metric)
    per_seed = [x.values[metric] - y.values[metric] for x, y in pairs]
    averaged = np.mean(per_seed, axis=0)
    mean, low, high = class_bootstrap(averaged, pairs[0][0].labels, resamples, seed, confidence)
    seeds = paired_t_interval([float(d.mean()) for d in per_seed], confidence)
    classes = len(np.unique(pairs[0][0].labels))
    return PointDifference(metric, Interval(mean, low, high, classes, confidence), seeds)
