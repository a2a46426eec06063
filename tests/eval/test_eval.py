"""Retrieval metrics and protocols; agreement with pytorch-metric-learning on the same embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddp_rank.eval.protocols import EmbeddedSet, EvalError, evaluate, subset_mask, subsets_to_bits
from ddp_rank.eval.report import format_count, format_table, write_json
from ddp_rank.eval.retrieval import faiss_available, knn_search, query_scores

BACKENDS = [
    "torch",
    pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(), reason="no faiss")),
]


def clustered(n: int = 300, classes: int = 40, dim: int = 16, noise: float = 0.9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    centers = torch.randn(classes, dim, generator=g)
    return F.normalize(centers[labels] + noise * torch.randn(n, dim, generator=g), dim=1), labels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_leave_one_out_agrees_with_pml(backend: str, seed: int) -> None:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    e, y = clustered(seed=seed)
    ref = AccuracyCalculator(include=("precision_at_1", "mean_average_precision_at_r"), k=None).get_accuracy(
        e, y
    )
    ours = query_scores(e, y, e, y, [1, 10], exclude_self=True, backend=backend, block=64).metrics()
    assert ours["recall@1"] == pytest.approx(ref["precision_at_1"], abs=1e-12)
    assert ours["map@r"] == pytest.approx(ref["mean_average_precision_at_r"], abs=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_query_gallery_agrees_with_pml(backend: str) -> None:
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    e, y = clustered(n=400, seed=3)
    q, qy, g, gy = e[:150], y[:150], e[150:], y[150:]
    ref = AccuracyCalculator(include=("precision_at_1", "mean_average_precision_at_r"), k=None).get_accuracy(
        q, qy, g, gy, ref_includes_query=False
    )
    ours = query_scores(q, qy, g, gy, [1], backend=backend).metrics()
    assert ours["recall@1"] == pytest.approx(ref["precision_at_1"], abs=1e-12)
    assert ours["map@r"] == pytest.approx(ref["mean_average_precision_at_r"], abs=1e-12)


def test_recall_by_hand_and_lone_queries() -> None:
    e = F.normalize(
        torch.tensor([[1.0, 0.0], [0.99, 0.141], [0.0, 1.0], [0.141, 0.99], [-0.9, 0.436]]), dim=1
    )
    y = torch.tensor([0, 0, 1, 2, 1])  # class 2 is alone; image 2 (class 1) is nearest to image 3 (class 2)
    m = query_scores(e, y, e, y, [1, 2, 10], exclude_self=True).metrics()
    assert m["num_lone_queries"] == 1 and m["num_queries"] == 4
    assert m["recall@1"] == pytest.approx(3 / 4)  # 0 and 1 find each other, 4 finds 2; 2 finds 3 first
    assert m["recall@2"] == 1.0
    assert m["recall@10"] == 1.0  # k larger than the database is clipped


@pytest.mark.parametrize("backend", BACKENDS)
def test_knn_search_backends_agree(backend: str) -> None:
    e, _ = clustered(n=200, seed=5)
    s_ref, i_ref = torch.topk(e[:50] @ e.T, 7, dim=1)
    s, i = knn_search(e[:50], e, 7, backend=backend, block=16)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


def test_sop_protocol_default_ks() -> None:
    e, y = clustered(n=120, classes=20)
    out = evaluate("sop", EmbeddedSet.from_lists(e, y.tolist(), [""] * 120))
    assert {"recall@1", "recall@10", "recall@100", "recall@1000", "map@r"} <= set(out)


def test_inshop_protocol_uses_query_and_gallery() -> None:
    e, y = clustered(n=200, seed=7)
    subsets = ["query" if i % 3 == 0 else "gallery" for i in range(200)]
    data = EmbeddedSet.from_lists(e, y.tolist(), subsets)
    out = evaluate("inshop", data, [1, 10])
    q, g = subset_mask(data, "query"), subset_mask(data, "gallery")
    direct = query_scores(e[q], y[q], e[g], y[g], [1, 10]).metrics()
    assert out["recall@1"] == direct["recall@1"] and out["num_queries"] == direct["num_queries"]
    with pytest.raises(EvalError, match="subset 'query' and 'gallery'"):
        evaluate("inshop", EmbeddedSet.from_lists(e, y.tolist(), [""] * 200))


def test_vehicleid_protocol_one_gallery_image_per_vehicle() -> None:
    e, y = clustered(n=300, classes=30, seed=2)
    sizes = ["small,medium,large" if c < 10 else ("medium,large" if c < 20 else "large") for c in y.tolist()]
    data = EmbeddedSet.from_lists(e, y.tolist(), sizes)
    out = evaluate("vehicleid", data, repeats=2)
    for size, n_classes in (("small", 10), ("medium", 20), ("large", 30)):
        n_images = int(subset_mask(data, size).sum())
        # every image but one per vehicle is a query
        assert out[f"{size}/num_queries"] == n_images - n_classes
        assert 0.0 <= out[f"{size}/recall@1"] <= out[f"{size}/recall@5"] <= 1.0
    assert out["recall@1"] == out["large/recall@1"]
    with pytest.raises(EvalError, match="subset 'small'"):
        evaluate("vehicleid", EmbeddedSet.from_lists(e, y.tolist(), ["large"] * 300))


def test_subset_tokens() -> None:
    assert subsets_to_bits("") == 0
    assert subsets_to_bits("Query") == 1
    assert subsets_to_bits("small, medium+large") == 0b11100
    assert subsets_to_bits("whatever") == 0


def test_table_and_json(tmp_path: Path) -> None:
    rows = {"raw pixels": {"recall@1": 0.25, "recall@10": 0.5}, "after": {"recall@1": 0.5, "map@r": 0.125}}
    table = format_table(rows).splitlines()
    assert table[0].split("|")[1:-1] == [" model      ", "   R@1 ", "  R@10 ", " MAP@R "]
    assert "| raw pixels | 25.00 | 50.00 |     - |" in table
    p = write_json({"after": rows["after"]}, tmp_path / "r" / "eval.json")
    assert json.loads(p.read_text())["after"]["recall@1"] == 0.5


def _gather_worker(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ddp_rank.eval.embed import gather_embedded

    # Uneven shares: rank 0 has 3 rows, rank 1 has 5; indices interleave so the sort matters.
    n = 3 if rank == 0 else 5
    idx = torch.arange(n) * 2 + rank
    emb = torch.stack([idx.float(), -idx.float()], dim=1)
    data = gather_embedded(emb, idx % 2, torch.zeros(n, dtype=torch.long), idx)
    return data.embeddings, data.labels, data.subset_bits


@pytest.mark.distributed
def test_padded_gather_of_uneven_shares() -> None:
    from tests.helpers.distributed import run_distributed

    results = run_distributed(_gather_worker, world_size=2)
    order = torch.tensor([0, 1, 2, 3, 4, 5, 7, 9])  # rank 0: 0,2,4  rank 1: 1,3,5,7,9
    for emb, labels, _ in results:
        torch.testing.assert_close(emb[:, 0], order.float())
        assert torch.equal(labels, order % 2)


def test_vehicleid_splits_from_the_data_layer_recipe(tmp_path: Path) -> None:
    """The VehicleID recipe writes test_small / test_large as splits: each is evaluated as its own test list."""
    from dataclasses import replace

    from ddp_rank.config import load_config
    from ddp_rank.data.building.build import BuildOptions, build_shards
    from ddp_rank.data.building.listing import read_image_folder
    from ddp_rank.data.building.synthetic import write_image_folder
    from ddp_rank.eval.runner import evaluate_model
    from ddp_rank.eval.settings import evaluation_settings
    from ddp_rank.model.net import build_model

    write_image_folder(tmp_path / "img", [[3] * 6, [3] * 6], image_size=16)
    records = []
    for r in read_image_folder(tmp_path / "img"):
        j = int(r.cls.split("_")[1])  # class index within its category
        if j < 2:
            records.append(replace(r, split="train"))
        else:
            records.append(replace(r, split="test_large"))
            if j < 4:
                records.append(replace(r, split="test_small"))
    build_shards(records, tmp_path / "shards", BuildOptions(progress=False))
    cfg = load_config(None, [f"data.shards={tmp_path / 'shards'}", "data.test_split=test_large",
                             "eval.protocol=vehicleid", "eval.vehicleid_sizes=small,large", "data.image_size=16",
                             "data.resize_size=16", "model.backbone=tiny_cnn", "data.num_workers=0"])  # fmt: skip
    out = evaluate_model(build_model(cfg.model, 16), evaluation_settings(cfg))
    assert out["small/num_queries"] == 2 * 2 * (3 - 1)  # 4 vehicles with 3 images, one in the gallery each
    assert out["large/num_queries"] == 2 * 4 * (3 - 1)
    assert out["recall@1"] == out["large/recall@1"] and "medium/recall@1" not in out
    cfg_medium = load_config(None, [f"data.shards={tmp_path / 'shards'}", "eval.protocol=vehicleid"])
    with pytest.raises(EvalError, match="but not test_medium"):
        evaluate_model(build_model(cfg.model, 16), evaluation_settings(cfg_medium))


def test_counts_print_as_whole_numbers_and_means_keep_one_decimal():
    """One count format for every table (compare, replicates): ``1,200``, a mean of counts ``1,200.5``, none ``-``."""
    assert format_count(1200) == "1,200"
    assert format_count(1200.0) == "1,200"
    assert format_count(1200.5) == "1,200.5"
    assert format_count(None) == "-"
