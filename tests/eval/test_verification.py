"""Verification over every pair of a split: against scikit-learn on the same scores, by hand with ties, the
degenerate splits, and the memory bound on a split whose pairs would not fit."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from ddp_rank.eval.verification import count_pairs, fpr_key, verification_metrics

RATES = (0.5, 0.1, 1e-2, 1e-3)


def pairs_of(e: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every unordered pair's score and whether it is positive: the N^2 reference the module avoids."""
    i, j = np.triu_indices(len(y), 1)
    return (e @ e.T)[i, j], y[i] == y[j]


def eer_from(fpr: np.ndarray, tpr: np.ndarray) -> float:
    """Where the straight lines between scikit-learn's ROC points cross FNR = FPR, by walking the segments."""
    for k in range(1, len(fpr)):
        a, b = (1 - tpr[k - 1]) - fpr[k - 1], (1 - tpr[k]) - fpr[k]
        if a > 0 >= b:
            return float(fpr[k - 1] + a / (a - b) * (fpr[k] - fpr[k - 1]))
    raise AssertionError("no crossing")


@pytest.mark.parametrize("seed", range(6))
def test_agrees_with_scikit_learn_on_the_same_scores(seed: int) -> None:
    sklearn_metrics = pytest.importorskip("sklearn.metrics")  # here, not at collection: 0.6 s a worker
    rng = np.random.default_rng(seed)
    n = int(rng.integers(40, 160))
    # Small integer coordinates: many equal scores, within and across positives and negatives.
    e = rng.integers(-2, 3, size=(n, 3)).astype(np.float32)
    y = rng.integers(0, int(rng.integers(3, 25)), size=n)
    ours, curves = verification_metrics(e, y, RATES, block_bytes=4096)  # many blocks, uneven last one
    s, positive = pairs_of(e, y)
    fpr, tpr, _ = sklearn_metrics.roc_curve(positive, s, drop_intermediate=False)
    assert ours["roc_auc"] == pytest.approx(sklearn_metrics.roc_auc_score(positive, s), abs=1e-12)
    assert ours["pr_auc"] == pytest.approx(sklearn_metrics.average_precision_score(positive, s), abs=1e-12)
    assert ours["eer"] == pytest.approx(eer_from(fpr, tpr), abs=1e-12)
    negatives = int((~positive).sum())
    for rate in RATES:
        expected = float(tpr[fpr <= rate].max()) if negatives * rate >= 1 else None
        assert ours[fpr_key("tpr@fpr", rate)] == pytest.approx(expected, abs=1e-12), rate
    assert (ours["num_positive_pairs"], ours["num_negative_pairs"]) == (int(positive.sum()), negatives)
    # The curve's points are points of scikit-learn's curve.
    theirs = set(zip(fpr.round(12), tpr.round(12), strict=True))
    drawn = zip(curves["roc"]["fpr"], curves["roc"]["tpr"], strict=True)
    assert all((round(a, 12), round(b, 12)) in theirs for a, b in drawn)


def test_by_hand_with_ties() -> None:
    # 1-d embeddings: scores are products. Labels a a b b: positives (0,1) = 2*1 = 2, (2,3) = 1*1 = 1;
    # negatives (0,2) = 2, (0,3) = 2, (1,2) = 1, (1,3) = 1. Two positives, four negatives, ties everywhere.
    e = np.array([[2.0], [1.0], [1.0], [1.0]], dtype=np.float32)
    y = np.array([0, 0, 1, 1])
    c = count_pairs(e, y)
    assert c.u.tolist() == [2.0, 1.0]
    assert c.pos_ge.tolist() == [1, 2] and c.neg_gt.tolist() == [0, 2] and c.neg_ge.tolist() == [2, 4]
    m, _ = verification_metrics(e, y, (0.5, 0.25))
    # ROC points: (0, 0) -> (2/4, 1/2) at t = 2 -> (1, 1) at t = 1. AUC = 1/2 * (1/2 * 1/2) + 1/2 * (3/4) = 1/2.
    assert m["roc_auc"] == pytest.approx(0.5)
    # FPR <= 0.5 allows the threshold 2: TPR 1/2. FPR <= 0.25 allows no threshold but the one above all: 0.
    assert m["tpr@fpr=5e-1"] == 0.5 and m["tpr@fpr=2.5e-1"] == 0.0
    # AP: at t = 2 precision 1/3 (recall 1/2), at t = 1 precision 2/6 (recall 1): 1/2 * 1/3 + 1/2 * 1/3.
    assert m["pr_auc"] == pytest.approx(1 / 3)
    # FNR - FPR: 1 at (0, 0), 0.5 - 0.5 = 0 at (1/2, 1/2): the curve crosses FNR = FPR there.
    assert m["eer"] == pytest.approx(0.5)


def test_a_single_class_has_no_negative_pair() -> None:
    e = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    m, curves = verification_metrics(e, np.zeros(10, dtype=np.int64))
    assert m["num_positive_pairs"] == 45 and m["num_negative_pairs"] == 0
    assert all(m[k] is None for k in ("tpr@fpr=1e-2", "roc_auc", "eer", "pr_auc")) and curves == {}


def test_a_rate_needing_more_negatives_than_the_split_has_is_not_measurable() -> None:
    rng = np.random.default_rng(1)
    e = rng.standard_normal((150, 8)).astype(np.float32)
    m, curves = verification_metrics(e, np.arange(150) // 3)  # 11,175 pairs: 150 positive, 11,025 negative
    assert m["num_negative_pairs"] == 11_025
    assert m["tpr@fpr=1e-4"] is not None  # 11,025 >= 10,000
    m, curves = verification_metrics(e[:140], np.arange(140) // 3)  # 9,730 - 139 < 10,000 negatives
    assert m["tpr@fpr=1e-4"] is None and m["tpr@fpr=1e-3"] is not None
    assert "tpr@fpr=1e-4" not in curves["roc"]["operating_points"]


def test_memory_stays_linear_on_a_split_whose_pairs_would_not_fit() -> None:
    """8,000 images: 32 M pairs, 128 MB as float32 scores (256 MB as float64). With 2 MiB blocks every array
    the computation allocates (numpy reports them all to tracemalloc) stays under 8 MiB."""
    n = 8_000
    rng = np.random.default_rng(0)
    e = rng.standard_normal((n, 8)).astype(np.float32)
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    y = np.arange(n) // 4
    tracemalloc.start()
    try:
        m, _ = verification_metrics(e, y, block_bytes=2 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert m["num_positive_pairs"] + m["num_negative_pairs"] == n * (n - 1) // 2
    assert peak < 8 << 20, f"peak {peak / 2**20:.1f} MiB"
    assert 4 * n * (n - 1) // 2 > 16 * peak  # the pairs' scores alone would take 16 times more


def test_too_many_positive_pairs_is_refused_with_the_setting() -> None:
    e = np.ones((100, 2), dtype=np.float32)
    with pytest.raises(ValueError, match=r"4,950 positive pairs.*eval.max_positive_pairs=1,000"):
        count_pairs(e, np.zeros(100, dtype=np.int64), max_positive_pairs=1000)


def test_metric_names() -> None:
    assert [fpr_key("tpr@fpr", r) for r in (1e-2, 1e-3, 1e-4, 0.25)] == [
        "tpr@fpr=1e-2",
        "tpr@fpr=1e-3",
        "tpr@fpr=1e-4",
        "tpr@fpr=2.5e-1",
    ]
