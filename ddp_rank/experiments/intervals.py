"""Student's t interval of a mean difference over paired replicates, with no statistics package.

Why a paired t interval and not a bootstrap: a point has 3 to 5 seeds, and a bootstrap over 3 values has only 10
distinct resamples, so its percentile interval is far too narrow; the t interval is exact when the per-seed
differences are normal and honest about how little 3 values say (t = 4.30 at 2 degrees of freedom). Pairing
by seed removes what two points share through the seed (the same initial weights, the same draws where the
settings allow) from the spread.

The quantile comes from the closed form of the t distribution's CDF for whole degrees of freedom (Abramowitz
and Stegun 26.7.3 and 26.7.4), inverted by bisection.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Interval", "paired_t_interval", "t_quantile"]

CONFIDENCE = 0.95


def _two_sided_mass(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with ``df`` whole degrees of freedom (t >= 0)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        total, term = 0.0, 1.0
        for j in range(1, (df - 1) // 2 + 1):  # 1 + 2/3 c^2 + (2*4)/(3*5) c^4 + ...
            total += term
            term *= c2 * (2 * j) / (2 * j + 1)
        series = math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0
        return 2 / math.pi * (theta + series)
    total, term = 0.0, 1.0
    for j in range(1, df // 2 + 1):  # 1 + 1/2 c^2 + (1*3)/(2*4) c^4 + ...
        total += term
        term *= c2 * (2 * j - 1) / (2 * j)
    return math.sin(theta) * total


def t_quantile(probability: float, df: int) -> float:
    """The ``probability`` quantile (above 0.5) of Student's t with ``df`` >= 1 degrees of freedom."""
    if df < 1 or not 0.5 < probability < 1:
        raise ValueError(f"t quantile needs df >= 1 and 0.5 < probability < 1 (got {df}, {probability})")
    mass = 2 * probability - 1
    low, high = 0.0, 1.0
    while _two_sided_mass(high, df) < mass:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _two_sided_mass(mid, df) < mass else (low, mid)
        if high - low < 1e-12 * max(1.0, high):
            break
    return (low + high) / 2


@dataclass(frozen=True)
class Interval:
    """The mean of the per-seed differences and its ``confidence`` interval over ``count`` seeds."""

    mean: float
    low: float
    high: float
    count: int
    confidence: float = CONFIDENCE

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
    return Interval(mean, mean - half, mean + half, n, confidence)
