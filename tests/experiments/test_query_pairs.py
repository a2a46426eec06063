"""The paired class bootstrap of a difference between two points (``experiments.query_pairs``), against a plain
resampling loop and against what pairing must do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ddp_rank.experiments.query_pairs import (
    QueryValues,
    class_bootstrap,
    compare_points,
    load_query_values,
    point_interval,
)


def _run(hits: np.ndarray, labels: np.ndarray) -> QueryValues:
    return QueryValues({"recall@1": hits.astype(np.float64)}, labels)


def test_class_bootstrap_equals_a_loop_that_draws_classes_with_all_their_queries() -> None:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(30), rng.integers(1, 6, size=30))
    values = rng.random(len(labels))
    mean, low, high = class_bootstrap(values, labels, resamples=400, seed=7)
    assert mean == pytest.approx(values.mean())
    draws = np.random.default_rng(7).multinomial(30, np.full(30, 1 / 30), size=400)
    loop = []
    for counts in draws:
        chosen = np.concatenate([np.flatnonzero(labels == c).repeat(n) for c, n in enumerate(counts)])
        loop.append(values[chosen].mean())
    assert (low, high) == pytest.approx(tuple(np.percentile(loop, [2.5, 97.5])))


def test_pairing_cancels_what_two_points_share() -> None:
    """Two points that differ by one hit in 50 queries, on a test set of very unequal classes: each point's own
    interval is wide, the paired one is narrow and excludes zero."""
    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(200), 5)
    easy = rng.random(200) < 0.5
    base = np.repeat(easy, 5).astype(float)
    better = base.copy()
    better[np.flatnonzero(base == 0)[::25]] = 1.0
    a, b = [_run(better, labels)] * 3, [_run(base, labels)] * 3
    diff = compare_points(a, b, "recall@1")
    _, own_low, own_high = class_bootstrap(base, labels)
    assert diff.queries.high - diff.queries.low < (own_high - own_low) / 3
    assert diff.queries.low > 0
    # the seeds agree exactly: zero spread, an interval of zero width that excludes zero
    assert diff.seeds is not None and diff.seeds.low == diff.seeds.high == pytest.approx(diff.mean)
    assert diff.combined is not None and diff.combined.df == pytest.approx(199), (
        "no spread over the seeds: the combined interval is the classes' alone, at their degrees of freedom"
    )
    assert diff.beyond_noise and diff.verdict == "higher"


def test_the_combined_interval_is_welch_satterthwaite_over_seeds_and_classes() -> None:
    """Recomputed by hand: the seeds' variance of the mean (3 values, 2 df), the class draws' variance (49 df),
    summed, with the Welch-Satterthwaite degrees of freedom and the t quantile from the density's integral."""
    labels = np.repeat(np.arange(50), 4)
    rng = np.random.default_rng(3)
    base = (rng.random(200) < 0.5).astype(float)
    a = [_run(np.clip(base + (rng.random(200) < p), 0, 1), labels) for p in (0.05, 0.10, 0.20)]
    b = [_run(base, labels)] * 3
    diff = compare_points(a, b, "recall@1", resamples=500, seed=4)
    assert diff.seeds is not None and diff.combined is not None
    per_seed = [x.values["recall@1"] - y.values["recall@1"] for x, y in zip(a, b, strict=True)]
    seed_var = np.var([d.mean() for d in per_seed], ddof=1) / 3
    draws = []
    for counts in np.random.default_rng(4).multinomial(50, np.full(50, 1 / 50), size=500):
        chosen = np.concatenate([np.flatnonzero(labels == c).repeat(n) for c, n in enumerate(counts)])
        draws.append(np.mean(per_seed, axis=0)[chosen].mean())
    class_var = np.var(draws, ddof=1)
    df = (seed_var + class_var) ** 2 / (seed_var**2 / 2 + class_var**2 / 49)
    assert diff.combined.df == pytest.approx(df)
    assert 2 < df < 51
    half = _t_quantile_by_integration(0.975, df) * np.sqrt(seed_var + class_var)
    assert (diff.combined.low, diff.combined.high) == pytest.approx(
        (diff.mean - half, diff.mean + half), rel=1e-5
    )
    assert diff.verdict == ("within noise" if diff.combined.within_noise else "higher")
    wider = diff.interval(1 - 0.05 / 6)
    assert wider is not None and wider.low < diff.combined.low and wider.high > diff.combined.high
    with pytest.raises(ValueError, match="the same number of runs"):
        compare_points(a, b[:2], "recall@1")


def _t_quantile_by_integration(probability: float, df: float) -> float:
    """Student's t quantile from its density (trapezoids on a fine grid, then bisection): independent of scipy."""
    from math import gamma, pi, sqrt

    scale = gamma((df + 1) / 2) / (sqrt(df * pi) * gamma(df / 2))

    def cdf(t: float) -> float:
        x = np.linspace(0, t, 20001)
        y = scale * (1 + x**2 / df) ** (-(df + 1) / 2)
        return 0.5 + float(np.sum((y[1:] + y[:-1]) / 2 * np.diff(x)))

    low, high = 0.0, 50.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if cdf(mid) < probability else (low, mid)
    return (low + high) / 2


def test_one_points_interval_combines_its_seeds_and_its_test_classes() -> None:
    """Recomputed by hand: the seeds' variance of the mean and the class draws' variance of the seed-averaged
    values, summed, at the Welch-Satterthwaite degrees of freedom; wider than the paired difference's."""
    labels = np.repeat(np.arange(80), 5)
    rng = np.random.default_rng(5)
    runs = [_run((rng.random(400) < p).astype(float), labels) for p in (0.55, 0.6, 0.7)]
    own = point_interval(runs, "recall@1", resamples=300, seed=2)
    assert own is not None
    means = [r.values["recall@1"].mean() for r in runs]
    seed_var = np.var(means, ddof=1) / 3
    averaged = np.mean([r.values["recall@1"] for r in runs], axis=0)
    draws = []
    for counts in np.random.default_rng(2).multinomial(80, np.full(80, 1 / 80), size=300):
        chosen = np.concatenate([np.flatnonzero(labels == c).repeat(n) for c, n in enumerate(counts)])
        draws.append(averaged[chosen].mean())
    class_var = np.var(draws, ddof=1)
    df = (seed_var + class_var) ** 2 / (seed_var**2 / 2 + class_var**2 / 79)
    half = _t_quantile_by_integration(0.975, df) * np.sqrt(seed_var + class_var)
    assert own.df == pytest.approx(df) and own.mean == pytest.approx(np.mean(means))
    assert (own.low, own.high) == pytest.approx((own.mean - half, own.mean + half), rel=1e-5)
    assert point_interval(runs[:1], "recall@1") is None


def test_within_noise_when_either_interval_holds_zero() -> None:
    labels = np.repeat(np.arange(100), 4)
    rng = np.random.default_rng(2)
    same = [_run((rng.random(400) < 0.6).astype(float), labels) for _ in range(3)]
    other = [_run((rng.random(400) < 0.6).astype(float), labels) for _ in range(3)]
    diff = compare_points(same, other, "recall@1")
    assert diff.queries.within_noise or (diff.seeds is not None and diff.seeds.within_noise)
    assert diff.verdict == "within noise"
    one_seed = compare_points(same[:1], other[:1], "recall@1")
    assert one_seed.seeds is None and not one_seed.beyond_noise, "one seed says nothing of training noise"


def test_runs_of_other_queries_are_refused() -> None:
    labels = np.repeat(np.arange(10), 2)
    a = [_run(np.ones(20), labels)]
    with pytest.raises(ValueError, match="scored other queries"):
        compare_points(a, [_run(np.ones(20), labels[::-1].copy())], "recall@1")
    with pytest.raises(ValueError, match="no per-query 'map@r'"):
        compare_points(a, a, "map@r")
    keyed = QueryValues({"recall@1": np.ones(20)}, labels, np.array([f"k{i}" for i in range(20)]))
    renamed = QueryValues({"recall@1": np.ones(20)}, labels, np.array([f"j{i}" for i in range(20)]))
    with pytest.raises(ValueError, match="keys differ"):
        compare_points([keyed], [renamed], "recall@1")


def test_load_reads_the_eval_file_layout(tmp_path: Path) -> None:
    path = tmp_path / "q.npz"
    np.savez(path, **{"recall@1": np.array([1.0, 0.0]), "map@r": np.array([0.5, 0.25]), "label": np.array([3, 3]),
                      "key": np.array(["a", "b"])})  # fmt: skip
    run = load_query_values(path)
    assert sorted(run.values) == ["map@r", "recall@1"] and run.labels.tolist() == [3, 3]
    assert run.keys is not None and run.keys.tolist() == ["a", "b"]
    np.savez(tmp_path / "bad.npz", x=np.zeros(2))
    with pytest.raises(ValueError, match="not a file of `ddp-rank eval --per-query`"):
        load_query_values(tmp_path / "bad.npz")
