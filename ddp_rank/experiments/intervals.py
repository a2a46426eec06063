"""Student's t intervals of a mean difference: over paired seeds, and over two independent sources of noise.

Why a paired t interval and not a bootstrap over seeds: a point has 3 to 5 seeds, and a bootstrap over 3 values has
only 10 distinct resamples, so its percentile interval is far too narrow; the t interval is exact when the per-seed
differences are normal and honest about how little 3 values say (t = 4.30 at 2 degrees of freedom). Pairing by
seed removes what two points share through the seed (the same initial weights, the same draws where the settings
allow) from the spread.

When a mean carries two independent noises (the training's, estimated from a few seeds, and the test set's,
estimated from its many classes), their variances add, and the Welch-Satterthwaite equation gives the degrees of
freedom of the sum: a fraction, between the fewer (the seeds') and the sum of both, so the t quantile is taken at
fractional degrees of freedom (scipy, the ``experiments`` extra).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ddp_rank.extras import install_hint

__all__ = ["Interval", "VarianceTerm", "combined_interval", "paired_t_interval", "t_quantile"]

CONFIDENCE = 0.95


def t_quantile(probability: float, df: float) -> float:
    """The ``probability`` quantile (above 0.5) of Student's t with ``df`` > 0 degrees of freedom (any real)."""
    if not df > 0 or not 0.5 < probability < 1:
        raise ValueError(f"t quantile needs df > 0 and 0.5 < probability < 1 (got {df}, {probability})")
    try:
        from scipy import stats
    except ImportError as exc:
        raise ImportError(
            f"intervals need scipy (t quantiles at fractional degrees of freedom): {install_hint('experiments')}"
        ) from exc
    return float(stats.t.ppf(probability, df))


@dataclass(frozen=True)
class Interval:
    """A mean and its ``confidence`` interval; ``count`` is what it was estimated from (seeds, or classes), ``df``
    the degrees of freedom of its quantile (None for a percentile interval)."""

    mean: float
    low: float
    high: float
    count: int
    confidence: float = CONFIDENCE
    df: float | None = None

    @property
    def within_noise(self) -> bool:
        """Whether the interval includes zero: the data cannot tell the two apart."""
        return self.low <= 0.0 <= self.high


def paired_t_interval(differences: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """``mean ± t(1 - (1 - confidence)/2, n - 1) * sd / sqrt(n)`` of per-seed differences; None under 2 seeds
    (one difference has no spread, and none is invented)."""
    n = len(differences)
    if n < 2:
        return None
    mean = statistics.fmean(differences)
    half = t_quantile(1 - (1 - confidence) / 2, n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, confidence, n - 1)


@dataclass(frozen=True)
class VarianceTerm:
    """One independent source of noise in a mean: its variance (of the mean, not of one value) and the degrees of
    freedom of that estimate."""

    variance: float
    df: float


def combined_interval(
    mean: float, terms: Sequence[VarianceTerm], count: int, confidence: float = CONFIDENCE
) -> Interval:
    """``mean ± t(df) * sqrt(sum of the variances)``, ``df`` by Welch-Satterthwaite:
    ``(sum v)^2 / sum(v^2 / df)``. With every variance zero the interval has no width."""
    total = sum(t.variance for t in terms)
    if not math.isfinite(total) or any(not t.df > 0 for t in terms):
        raise ValueError(f"a variance term is not finite or has no degrees of freedom: {list(terms)}")
    if total <= 0:
        return Interval(mean, mean, mean, count, confidence, math.inf)
    df = total**2 / sum(t.variance**2 / t.df for t in terms if t.variance > 0)
    half = t_quantile(1 - (1 - confidence) / 2, df) * math.sqrt(total)
    return Interval(mean, mean - half, mean + half, count, confidence, df)
