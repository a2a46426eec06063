"""The query bootstrap of ``ddp-rank eval --bootstrap``: the spread of Recall@k and MAP@R over the test queries,
against the exact bootstrap distribution of small cases, seeded; the per-query hits against a brute-force
search; the table's ``value ± se``; the command on tiny shards."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_rank.cli import main
from ddp_rank.eval.bootstrap import QueryBootstrap, bootstrap_queries
from ddp_rank.eval.protocols import EmbeddedSet, evaluate
from ddp_rank.eval.report import format_table
from ddp_rank.eval.retrieval import QueryScores, query_scores
from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards


def scores(hits: list[bool], ap: list[float] | None = None) -> QueryScores:
    return QueryScores({1: np.array(hits)}, None if ap is None else np.array(ap), num_lone_queries=0)


def test_the_standard_error_is_the_bootstrap_distributions_own() -> None:
    """A mean of n values resampled with replacement has variance (population variance) / n exactly."""
    out = bootstrap_queries(scores([True, False, True, True], [1.0, 0.2, 0.5, 0.7]), QueryBootstrap(20000, 0))
    recall, ap = out["metrics"]["recall@1"], out["metrics"]["map@r"]
    assert recall["se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4), rel=0.03)
    population_variance = ((0.4**2) * 2 + (0.1**2) * 2) / 4  # values around their mean 0.6
    assert ap["se"] == pytest.approx(math.sqrt(population_variance / 4), rel=0.03)
    assert out["resamples"] == 20000 and out["seed"] == 0


def test_the_interval_is_the_exact_distributions_percentiles() -> None:
    """Hits 1, 0, 0: a resample's recall is k/3 with k ~ Binomial(3, 1/3): P(k=0) = 8/27 > 2.5%, so the low end
    is 0; P(k <= 2) = 26/27 < 97.5%, so the high end is 1."""
    out = bootstrap_queries(scores([True, False, False]), QueryBootstrap(4000, 3))["metrics"]["recall@1"]
    assert (out["low"], out["high"]) == (0.0, 1.0)
    assert out["se"] == pytest.approx(math.sqrt((1 / 3) * (2 / 3) / 3), rel=0.04)


def test_the_bootstrap_is_seeded() -> None:
    data = scores([True, False, True, False, True, True, False], [0.9, 0.1, 0.5, 0.3, 0.8, 0.6, 0.2])
    first = bootstrap_queries(data, QueryBootstrap(300, 5))
    assert first == bootstrap_queries(data, QueryBootstrap(300, 5))
    assert first != bootstrap_queries(data, QueryBootstrap(300, 6))
    with pytest.raises(ValueError, match="2 or more"):
        QueryBootstrap(1)


def test_per_query_hits_match_a_brute_force_search_and_the_protocol_carries_the_spread() -> None:
    gen = torch.Generator().manual_seed(0)
    e = torch.nn.functional.normalize(torch.randn(60, 8, generator=gen), dim=1)
    y = torch.arange(60) // 4
    per_query = query_scores(e, y, e, y, [1, 3], exclude_self=True, backend="torch")
    sims = (e @ e.T).numpy()
    np.fill_diagonal(sims, -np.inf)
    order = np.argsort(-sims, axis=1)
    brute = {k: (y.numpy()[order[:, :k]] == y.numpy()[:, None]).any(axis=1) for k in (1, 3)}
    for k in (1, 3):
        np.testing.assert_array_equal(per_query.hits[k], brute[k])
    data = EmbeddedSet.from_lists(e, y.tolist(), [None] * 60)
    result = evaluate("sop", data, [1, 3], backend="torch", bootstrap=QueryBootstrap(500, 0))
    spread = result["bootstrap"]["metrics"]
    assert set(spread) == {"recall@1", "recall@3", "map@r"}
    assert result["recall@1"] == pytest.approx(brute[1].mean())
    for name, s in spread.items():
        assert s["low"] <= result[name] <= s["high"] and s["se"] > 0
    assert "bootstrap" not in evaluate("sop", data, [1], backend="torch")


def test_the_table_shows_value_plus_minus_standard_error() -> None:
    metrics = {"recall@1": 0.528, "map@r": 0.3, "num_queries": 10,
               "bootstrap": {"resamples": 100, "seed": 0, "metrics": {"recall@1": {"se": 0.009}}}}  # fmt: skip
    table = format_table({"trained": metrics})
    assert "52.80 ± 0.90" in table and "30.00" in table and "bootstrap" not in table


@pytest.mark.slow
def test_eval_bootstrap_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    shards = build_tiny_shards(tmp_path)
    out = tmp_path / "eval.json"
    args = ["eval", "--baseline", "raw-pixels", *TINY_OVERRIDES, f"data.shards={shards}",
            f"train.output_dir={tmp_path}", "--output", str(out)]  # fmt: skip
    assert main([*args, "--bootstrap", "200", "--bootstrap-seed", "4"]) == 0
    printed = capsys.readouterr().out
    assert " ± " in printed and "200 bootstrap resamples (seed 4)" in printed
    spread = json.loads(out.read_text())["raw pixels"]["metrics"]["bootstrap"]
    assert spread["resamples"] == 200 and set(spread["metrics"]) == {"recall@1", "recall@2", "map@r"}
    assert main([*args, "--bootstrap", "1"]) == 2
    assert "--bootstrap 1: give 2 or more" in capsys.readouterr().err
    assert main([*args, "--bootstrap", "50", "eval.protocol=vehicleid"]) == 2
    assert "leave out --bootstrap" in capsys.readouterr().err
