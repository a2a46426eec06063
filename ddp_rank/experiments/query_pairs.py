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

``compare_points`` gives both intervals and calls the difference beyond noise only where both exclude zero with
the same sign, else "within noise": with 3 seeds neither interval alone holds all the noise.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddp_rank.experiments.intervals import CONFIDENCE, Interval, paired_t_interval

__all__ = ["PointDifference", "QueryValues", "class_bootstrap", "compare_points", "load_query_values"]

RESAMPLES = 2000
"""Class draws of a bootstrap (the 2.5th and 97.5th percentiles of 2,000 draws move by about 0.02 points between
bootstrap seeds on the word study's 5,198 test classes)."""


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
    class bootstrap of the seed-averaged per-query difference) and over the seeds (``seeds``: paired t; None under
    two seeds)."""

    metric: str
    queries: Interval
    seeds: Interval | None

    @property
    def mean(self) -> float:
        return self.queries.mean

    @property
    def beyond_noise(self) -> bool:
        """Both intervals exclude zero, on the same side: neither the test classes nor the seeds explain it."""
        sides = [i for i in (self.queries, self.seeds) if i is not None]
        if len(sides) < 2 or any(i.within_noise for i in sides):
            return False
        return len({i.mean > 0 for i in sides}) == 1

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
    pairs = list(zip(a, b, strict=False))
    if not pairs:
        raise ValueError("compare_points needs at least one run of each point")
    _check_same_queries([run for pair in pairs for run in pair], metric)
    per_seed = [x.values[metric] - y.values[metric] for x, y in pairs]
    averaged = np.mean(per_seed, axis=0)
    mean, low, high = class_bootstrap(averaged, pairs[0][0].labels, resamples, seed, confidence)
    seeds = paired_t_interval([float(d.mean()) for d in per_seed], confidence)
    return PointDifference(metric, Interval(mean, low, high, len(pairs), confidence), seeds)
