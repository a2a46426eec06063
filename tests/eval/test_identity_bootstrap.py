"""The bootstrap over identities of ``eval --bootstrap`` for the verification and identification figures: the
weighted pair counts against scikit-learn's weighted ROC AUC and AP and a brute-force TPR@FPR, the weighted
probes against repeated ones, the standard error against the spread over independent test sets of a simulated
population, and the entry ``evaluate`` writes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ddp_rank.eval.bootstrap import QueryBootstrap
from ddp_rank.eval.identification import ProbeOutcomes, identification_figures, probe_outcomes
from ddp_rank.eval.identity_bootstrap import (
    bootstrap_identification,
    bootstrap_verification,
    weighted_pair_counts,
)
from ddp_rank.eval.protocols import EmbeddedSet, evaluate
from ddp_rank.eval.report import bootstrap_note, format_table
from ddp_rank.eval.verification import figures_from_counts, verification_metrics


def weighted_pairs(e: np.ndarray, y: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(score, is positive, weight) of every pair of rows whose identities were drawn, written out one by one."""
    scores, positive, weights = [], [], []
    for i in range(len(y)):
        for j in range(i + 1, len(y)):
            wi, wj = m[y[i]], m[y[j]]
            if wi == 0 or wj == 0:
                continue
            scores.append(float(e[i] @ e[j]))
            positive.append(y[i] == y[j])
            weights.append(wi if y[i] == y[j] else wi * wj)
    return np.array(scores), np.array(positive), np.array(weights, dtype=np.float64)


def brute_tpr_at_fpr(s: np.ndarray, pos: np.ndarray, w: np.ndarray, rate: float) -> float | None:
    negatives = w[~pos].sum()
    if negatives * rate < 1:
        return None
    allowed = math.floor(negatives * rate + 1e-9)
    best = 0.0
    for t in np.unique(s[pos]):
        if w[~pos & (s >= t)].sum() <= allowed:
            best = max(best, w[pos & (s >= t)].sum() / w[pos].sum())
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_weighted_counts_give_the_weighted_figures(seed: int) -> None:
    sklearn = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 12, size=70)
    e = rng.integers(-2, 3, size=(70, 3)).astype(np.float32)  # many equal scores
    m = rng.integers(0, 4, size=12)  # identities drawn 0 to 3 times
    m[:2] = (1, 2)
    ours, _ = figures_from_counts(weighted_pair_counts(e, y, m[y]), fprs=(0.01, 0.05, 1e-4))
    s, pos, w = weighted_pairs(e, y, m)
    assert ours["roc_auc"] == pytest.approx(sklearn.roc_auc_score(pos, s, sample_weight=w), abs=1e-12)
    assert ours["pr_auc"] == pytest.approx(
        sklearn.average_precision_score(pos, s, sample_weight=w), abs=1e-12
    )
    for rate, key in ((0.01, "tpr@fpr=1e-2"), (0.05, "tpr@fpr=5e-2"), (1e-4, "tpr@fpr=1e-4")):
        expected = brute_tpr_at_fpr(s, pos, w, rate)
        assert ours[key] == (None if expected is None else pytest.approx(expected, abs=1e-12)), key


def test_weights_of_one_give_the_evaluation_itself() -> None:
    rng = np.random.default_rng(3)
    y = rng.integers(0, 15, size=90)
    e = rng.standard_normal((90, 5)).astype(np.float32)
    plain, _ = verification_metrics(e, y)
    weighted, _ = figures_from_counts(weighted_pair_counts(e, y, np.ones(90)))
    assert {k: plain[k] for k in weighted if not k.startswith("num_")} == {
        k: pytest.approx(v, abs=1e-12) if v is not None else None
        for k, v in weighted.items()
        if not k.startswith("num_")
    }


def test_weighted_probes_are_repeated_probes() -> None:
    rng = np.random.default_rng(4)
    y = rng.integers(0, 30, size=200)
    e = rng.integers(-2, 3, size=(200, 3)).astype(np.float32)
    o = probe_outcomes(e, y, enrolled_fraction=0.4, seed=1)
    wm = rng.integers(0, 4, size=len(o.rank_of))
    wn = rng.integers(0, 4, size=len(o.top))
    repeated = ProbeOutcomes(o.split, np.repeat(o.rank_of, wm), np.repeat(o.right_score, wm), np.repeat(o.top, wn),
                             o.gallery_size, o.gallery_identities)  # fmt: skip
    fpirs = (0.02, 0.1, 0.3)
    assert identification_figures(o, (1, 2, 5), fpirs, wm, wn) == pytest.approx(
        identification_figures(repeated, (1, 2, 5), fpirs)
    )


def population_sample(
    rng: np.random.Generator, identities: int, per_identity: int = 4
) -> tuple[np.ndarray, np.ndarray]:
    """A test set drawn from a population whose identities differ in how tight their images are."""
    centres = rng.standard_normal((identities, 8))
    spread = rng.uniform(0.3, 1.6, size=identities)  # some identities are easy, some hard
    y = np.repeat(np.arange(identities), per_identity)
    e = centres[y] + spread[y, None] * rng.standard_normal((len(y), 8))
    return (e / np.linalg.norm(e, axis=1, keepdims=True)).astype(np.float32), y


@pytest.mark.slow
def test_the_standard_error_is_the_spread_over_test_sets() -> None:
    """The bootstrap's standard error of ROC AUC on one test set of 25 identities estimates how much ROC AUC
    varies from one test set to another of the same population (measured here over 200 independent sets:
    0.031; the mean of the four standard errors: 0.032)."""
    rng = np.random.default_rng(0)
    aucs = [verification_metrics(*population_sample(rng, 25))[0]["roc_auc"] for _ in range(200)]
    truth = float(np.std(aucs, ddof=1))
    errors = [
        bootstrap_verification(*population_sample(rng, 25), QueryBootstrap(150, seed))["roc_auc"]["se"]
        for seed in range(4)
    ]
    assert 0.6 < float(np.mean(errors)) / truth < 1.5, (errors, truth)


def test_seeded_and_measured_counts_where_a_figure_is_not_always_measurable() -> None:
    e, y = population_sample(np.random.default_rng(1), 12)
    first = bootstrap_verification(e, y, QueryBootstrap(40, 7), fprs=(1e-2, 1e-3))
    assert first == bootstrap_verification(e, y, QueryBootstrap(40, 7), fprs=(1e-2, 1e-3))
    assert first != bootstrap_verification(e, y, QueryBootstrap(40, 8), fprs=(1e-2, 1e-3))
    # About 1,000 negative pairs (48 images of 12 identities): 1e-3 measurable in some resamples only.
    assert "measured" in first["tpr@fpr=1e-3"] and 2 <= first["tpr@fpr=1e-3"]["measured"] < 40
    assert "measured" not in first["roc_auc"] and first["roc_auc"]["low"] <= first["roc_auc"]["high"]
    o = probe_outcomes(e, y, seed=0)
    spread = bootstrap_identification(o, y, QueryBootstrap(40, 0), ranks=(1, 5), fpirs=(0.1,))
    assert set(spread) == {"cmc@1", "cmc@5", "fnir@fpir=1e-1"} and spread["cmc@1"]["se"] > 0


def test_evaluate_writes_one_bootstrap_entry_for_every_figure() -> None:
    e, y = population_sample(np.random.default_rng(2), 10)
    data = EmbeddedSet.from_lists(torch.from_numpy(e), y.tolist(), [None] * len(y))
    settings = QueryBootstrap(30, 0)
    verified = evaluate("verification", data, bootstrap=settings)["bootstrap"]
    assert verified["over"] == ["identities"] and verified["resamples"] == 30
    assert {"roc_auc", "eer", "pr_auc", "tpr@fpr=1e-2"} <= set(verified["metrics"])
    both = evaluate("sop", data, [1], backend="torch", metrics=["identification"], bootstrap=settings)
    spread = both["bootstrap"]
    assert spread["over"] == ["queries", "identities"] and {"recall@1", "map@r", "cmc@1"} <= set(
        spread["metrics"]
    )
    metrics = {k: v for k, v in both.items() if k != "curves"}
    table = format_table({"model": metrics})
    assert f"{100 * both['cmc@1']:.2f} ± {100 * spread['metrics']['cmc@1']['se']:.2f}" in table
    assert "over the queries (Recall@k, MAP@R) and the identities" in bootstrap_note(metrics)
    assert "over the identities: 30 bootstrap" in bootstrap_note({"bootstrap": verified})
