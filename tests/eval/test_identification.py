"""Identification (CMC, FNIR@FPIR) against a per-probe loop and by hand; the protocols and the figures beside
them; the distributed evaluation (every rank embeds part of the split) against one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_rank.eval.identification import identification_metrics, split_identities
from ddp_rank.eval.protocols import EmbeddedSet, EvalError, evaluate, metric_names


def reference(e: np.ndarray, y: np.ndarray, split, ranks, fpirs) -> dict[str, float | None]:
    """Probe by probe, identity by identity, in plain Python."""
    gallery_ids = sorted({int(y[g]) for g in split.gallery})

    def best(probe: int) -> dict[int, float]:
        scores: dict[int, float] = {}
        for g in split.gallery:
            s = float(e[probe] @ e[g])
            scores[int(y[g])] = max(scores.get(int(y[g]), -np.inf), s)
        return scores

    mated = []
    for p in split.mated:
        b = best(p)
        right = b[int(y[p])]
        rank = sum(1 for i in gallery_ids if b[i] >= right)
        mated.append((rank, right))
    tops = sorted((max(best(p).values()) for p in split.non_mated), reverse=True)
    out: dict[str, float | None] = {f"cmc@{r}": sum(k <= r for k, _ in mated) / len(mated) for r in ranks}
    for f, key in fpirs:
        if len(tops) * f < 1:
            out[key] = None
            continue
        allowed = int(np.floor(len(tops) * f + 1e-9))
        threshold = tops[allowed] if allowed < len(tops) else -np.inf
        out[key] = 1 - sum(k == 1 and s > threshold for k, s in mated) / len(mated)
    return out


@pytest.mark.parametrize(("seed", "per_identity"), [(0, 1), (1, 1), (2, 0), (3, 2)])
def test_agrees_with_a_probe_by_probe_loop_with_ties(seed: int, per_identity: int) -> None:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 40, size=300)
    e = rng.integers(-2, 3, size=(300, 3)).astype(np.float32)  # many equal scores
    ours, curves = identification_metrics(
        e, y, ranks=(1, 5), fpirs=(0.1, 0.01), gallery_per_identity=per_identity, seed=seed, block_bytes=2048
    )
    split = split_identities(y, 0.5, per_identity, seed)
    expected = reference(e, y, split, (1, 5), [(0.1, "fnir@fpir=1e-1"), (0.01, "fnir@fpir=1e-2")])
    for key, value in expected.items():
        assert ours[key] == pytest.approx(value, abs=1e-12), key
    assert ours["gallery_size"] == len(split.gallery)
    assert curves["cmc"]["rate"][0] == ours["cmc@1"] and curves["cmc"]["rate"][4] == ours["cmc@5"]


def test_the_split_is_seeded_disjoint_and_as_documented() -> None:
    y = np.repeat(np.arange(10), 4)  # 10 identities of 4 images
    a, b = split_identities(y, 0.3, 1, seed=5), split_identities(y, 0.3, 1, seed=5)
    assert all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("gallery", "mated", "non_mated"))
    assert len(a.gallery) == 3 and len(a.mated) == 3 * 3 and len(a.non_mated) == 7 * 4
    rows = np.concatenate([a.gallery, a.mated, a.non_mated])
    assert sorted(rows.tolist()) == list(range(40))
    assert set(y[a.gallery]) == set(y[a.mated]) and not set(y[a.gallery]) & set(y[a.non_mated])
    everything_but_one = split_identities(y, 0.3, 0, seed=5)
    assert len(everything_but_one.gallery) == 3 * 3 and len(everything_but_one.mated) == 3
    assert not np.array_equal(split_identities(y, 0.3, 1, seed=6).non_mated, a.non_mated)


def test_by_hand_closed_set_and_an_empty_open_set() -> None:
    # A: a1 (1, 0), a2 (0.8, 0.6); B: b1 (0, 1), b2 (0.6, 0.8). a2.b2 = 0.96 beats a2.a1 = 0.8: with a1 and b2 in
    # the gallery, probe a2 ranks its own identity second.
    e = np.array([[1, 0], [0.8, 0.6], [0, 1], [0.6, 0.8]], dtype=np.float32)
    y = np.array([0, 0, 1, 1])
    for seed in range(6):
        m, _ = identification_metrics(e, y, ranks=(1, 2), enrolled_fraction=1.0, seed=seed)
        gallery = set(split_identities(y, 1.0, 1, seed).gallery.tolist())
        expected = 0.5 if gallery in ({0, 3}, {1, 2}) else 1.0
        assert m["cmc@1"] == expected and m["cmc@2"] == 1.0
        assert m["gallery_size"] == 2 and m["num_mated_probes"] == 2 and m["num_non_mated_probes"] == 0
        assert m["fnir@fpir=1e-1"] is None and m["fnir@fpir=1e-2"] is None  # no stranger: not measurable


def test_one_identity_enrols_nothing_at_half() -> None:
    m, curves = identification_metrics(
        np.eye(3, dtype=np.float32), np.zeros(3, dtype=np.int64), enrolled_fraction=0.4
    )
    assert m["gallery_size"] == 0 and m["num_non_mated_probes"] == 3 and m["cmc@1"] is None and curves == {}


def test_fnir_by_hand() -> None:
    # One enrolled identity (gallery g = (1, 0)), its probe at 0.9; ten strangers at 0.1 ... 0.95.
    g, probe = [1.0, 0.0], [0.9, np.sqrt(1 - 0.81)]
    strangers = [[s, np.sqrt(1 - s * s)] for s in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.95)]
    e = np.array([g, probe, *strangers], dtype=np.float32)
    y = np.array([0, 0, *range(1, 11)])
    # A seed whose split enrols identity 0 only (1/11 of the identities), with row 0 as its gallery image.
    seed = next(s for s in range(500) if split_identities(y, 1 / 11, 1, s).gallery.tolist() == [0])
    m, _ = identification_metrics(e, y, fpirs=(0.05, 0.1, 0.2), enrolled_fraction=1 / 11, seed=seed)
    # FPIR 0.1: one stranger in ten (0.95) may pass, the threshold is the next one (0.85): the probe (0.9)
    # passes. FPIR 0.2: threshold 0.8, it passes too. FPIR 0.05 needs 20 strangers: not measurable.
    assert m["fnir@fpir=1e-1"] == 0.0 and m["fnir@fpir=2e-1"] == 0.0 and m["fnir@fpir=5e-2"] is None
    assert m["num_non_mated_probes"] == 10 and m["gallery_identities"] == 1 and m["cmc@1"] == 1.0
    # Without the stranger at 0.95 and with one at 0.92 instead, FPIR 0.1 puts the threshold at 0.92: missed.
    e[11] = [0.92, np.sqrt(1 - 0.92**2)]
    m, _ = identification_metrics(e, y, fpirs=(0.1,), enrolled_fraction=1 / 11, seed=seed)
    assert m["fnir@fpir=1e-1"] == 0.0  # 0.95 -> 0.92 is still the one allowed through: threshold 0.85
    e[10] = [0.93, np.sqrt(1 - 0.93**2)]  # two strangers above the probe now: threshold 0.92
    m, _ = identification_metrics(e, y, fpirs=(0.1,), enrolled_fraction=1 / 11, seed=seed)
    assert m["fnir@fpir=1e-1"] == 1.0


def test_protocols_and_the_figures_beside_them() -> None:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(60) // 3
    e = torch.nn.functional.normalize(
        torch.randn(20, 8, generator=g)[y] + 0.5 * torch.randn(60, 8, generator=g)
    )
    data = EmbeddedSet(e, y, torch.zeros(60, dtype=torch.long))
    verification = evaluate("verification", data)
    assert set(verification) == {*metric_names("verification"), "curves"}
    assert set(verification["curves"]) == {"roc", "pr"}
    identification = evaluate("identification", data, ks=[1, 3])
    assert set(identification) == {*metric_names("identification", [1, 3]), "curves"}
    both = evaluate("sop", data, ks=[1], metrics=["verification", "identification"])
    assert set(both) == {*metric_names("sop", [1], metrics=["verification", "identification"]), "curves"}
    assert both["roc_auc"] == verification["roc_auc"] and "recall@1" in both and "cmc@1" in both
    assert set(evaluate("sop", data)) == set(metric_names("sop"))  # nothing added unless asked
    with pytest.raises(EvalError, match=r"not available beside eval\.protocol=vehicleid"):
        evaluate("vehicleid", data, metrics=["verification"])


def _evaluate_worker(rank: int, world: int, shards: str) -> dict:
    return _evaluate(shards)


def _evaluate(shards: str) -> dict:
    from ddp_rank.config import load_config
    from ddp_rank.eval.runner import evaluate_model
    from ddp_rank.eval.settings import evaluation_settings
    from ddp_rank.model.net import build_model
    from tests.helpers.training import TINY_OVERRIDES

    cfg = load_config(None, [*TINY_OVERRIDES, f"data.shards={shards}", "eval.protocol=verification",
                             "eval.metrics=[identification]", "eval.enrolled_fraction=0.5"])  # fmt: skip
    torch.manual_seed(0)
    return evaluate_model(build_model(cfg.model, cfg.data.image_size), evaluation_settings(cfg))


@pytest.mark.distributed
def test_two_ranks_embedding_halves_give_the_figures_of_one_process(tmp_path: Path) -> None:
    from tests.helpers.distributed import run_distributed
    from tests.helpers.training import build_tiny_shards

    shards = str(build_tiny_shards(tmp_path))
    alone = _evaluate(shards)
    assert alone["num_negative_pairs"] > 0 and alone["num_non_mated_probes"] > 0
    for result in run_distributed(_evaluate_worker, world_size=2, args=(shards,)):
        assert result.keys() == alone.keys()
        for key, value in alone.items():
            assert result[key] == (pytest.approx(value, abs=1e-6) if isinstance(value, float) else value), key
