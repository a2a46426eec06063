"""How precise one evaluation is: a bootstrap over the test split's queries.

The test classes are a sample, and so are their queries: another draw of the same size would give another
Recall@1. Resampling the queries with replacement (``resamples`` times, seeded) and taking each metric's mean
over every resample gives that number's spread; its standard deviation is the standard error shown as
``52.80 ± 0.90``, and its 2.5th and 97.5th percentiles a 95% interval. The metrics are means of per-query
values (a hit at k, AP@R: ``ddp_rank.eval.retrieval.QueryScores``), so no search is run again.

What it leaves out: the noise of training (seeds; ``ddp-rank sweep --replicates``), and the correlation between
queries of one class, which share their relevant items: the spread is a lower bound when classes are large.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ddp_rank.eval.retrieval import QueryScores

__all__ = ["QueryBootstrap", "bootstrap_queries", "spread"]

RESAMPLES_PER_BLOCK_ELEMENTS = 1 << 24
"""Most drawn indices held at once (128 MiB of int64): SOP's 60k queries go 279 resamples at a time."""


@dataclass(frozen=True)
class QueryBootstrap:
    """``resamples`` draws of the queries with replacement from a generator seeded with ``seed`` (of the
    identities for the verification and identification figures: ``ddp_rank.eval.identity_bootstrap``)."""

    resamples: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.resamples < 2:
            raise ValueError(f"--bootstrap {self.resamples}: give 2 or more resamples (1000 is usual)")


def bootstrap_queries(scores: QueryScores, settings: QueryBootstrap) -> dict[str, Any]:
    """``{"resamples": B, "seed": s, "over": ["queries"], "metrics": {"recall@1": {"se", "low", "high"}, ...}}``
    (fractions)."""
    values = scores.per_query()
    n = scores.num_queries
    table = np.stack(list(values.values()), axis=1) if values else np.zeros((n, 0))  # [n, metrics]
    resampled = np.full((settings.resamples, table.shape[1]), np.nan)  # each resample's metrics
    rng = np.random.default_rng(settings.seed)
    step = max(1, RESAMPLES_PER_BLOCK_ELEMENTS // max(n, 1))
    for start in range(0, settings.resamples if n else 0, step):
        count = min(step, settings.resamples - start)
        drawn = rng.integers(0, n, size=(count, n))
        # How often each query was drawn, times its values: one matrix product instead of a gather per metric.
        times = np.stack([np.bincount(row, minlength=n) for row in drawn]).astype(np.float64)
        resampled[start : start + count] = times @ table / n
    means = {name: resampled[:, i] for i, name in enumerate(values)}
    return {
        "resamples": settings.resamples,
        "seed": settings.seed,
        "over": ["queries"],
        "metrics": {name: spread(m) for name, m in means.items()},
    }


def spread(values: np.ndarray) -> dict[str, float]:
    """``{"se", "low", "high"}`` of one figure over its resamples: the standard deviation (the standard error of
    the figure) and the 2.5th and 97.5th percentiles (a 95% interval)."""
    return {
        "se": float(np.std(values, ddof=1)),
        "low": float(np.percentile(values, 2.5)),
        "high": float(np.percentile(values, 97.5)),
    }
