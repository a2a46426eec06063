"""The paired class bootstrap of a difference between two points (``experiments.query_pairs``), against a plain
resampling loop and against what pairing must do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ddp_rank.experiments.query_pairs import QueryValues, class_bootstrap, compare_points, load_query_values


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
    assert diff.combined is not None and (diff.combined.low, diff.combined.high) == pytest.approx(
        (diff.queries.low, diff.queries.high)
    ), "no spread over the seeds: the combined interval is the classes' one"
    assert diff.beyond_noise and diff.verdict == "higher"


def test_the_combined_interval_adds_the_half_widths_in_quadrature() -> None:
    labels = np.repeat(np.arange(50), 4)
    rng = np.random.default_rng(3)
    base = (rng.random(200) < 0.5).astype(float)
    a = [_run(np.clip(base + (rng.random(200) < p), 0, 1), labels) for p in (0.05, 0.10, 0.20)]
    b = [_run(base, labels)] * 3
    diff = compare_points(a, b, "recall@1")
    assert diff.seeds is not None and diff.combined is not None
    seed_half = (diff.seeds.high - diff.seeds.low) / 2
    assert diff.combined.high - diff.mean == pytest.approx(np.hypot(diff.queries.high - diff.mean, seed_half))
    assert diff.mean - diff.combined.low == pytest.approx(np.hypot(diff.mean - diff.queries.low, seed_half))
    assert diff.verdict == ("within noise" if diff.combined.within_noise else "higher")
    with pytest.raises(ValueError, match="the same number of runs"):
        compare_points(a, b[:2], "recall@1")


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
