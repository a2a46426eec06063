"""benchmarks/category_confusion.py: Recall@1 and the share of top-1 mistakes inside the query's category, on
vectors whose neighbours are worked out by hand, and read back from feature shards."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.category_confusion import confusion, nearest_other, read_split
from ddp_rank.data.features.synthetic import write_feature_shards


def _on_circle(degrees: list[float]) -> torch.Tensor:
    return torch.tensor([[math.cos(math.radians(d)), math.sin(math.radians(d))] for d in degrees])


def test_mistakes_by_hand() -> None:
    # classes 0, 1 of category 0 and 2, 3 of category 1, two images each, at these angles: the nearest other
    # image is the closest angle (0<->10 right; 100->105, 200->195, 105->100, 195->200 wrong across categories;
    # 300<->305 wrong inside category 1)
    vectors = _on_circle([0, 10, 100, 200, 105, 300, 305, 195])
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    categories = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert nearest_other(vectors).tolist() == [1, 0, 4, 7, 2, 6, 5, 3]
    result = confusion(vectors, labels, categories)
    assert result.queries == 8 and result.recall_at_1 == pytest.approx(2 / 8)
    assert result.mistakes == 6 and result.same_category == pytest.approx(2 / 6)
    assert result.chance == pytest.approx((4 - 2) / (8 - 2)), "2 of the 6 images of other classes share a category"


def test_blocks_do_not_change_the_neighbours() -> None:
    vectors = torch.from_numpy(np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32))
    sim = torch.nn.functional.normalize(vectors, dim=1) @ torch.nn.functional.normalize(vectors, dim=1).T
    sim.fill_diagonal_(-torch.inf)
    assert torch.equal(nearest_other(vectors, block=7), sim.argmax(dim=1))


def test_reads_feature_shards(tmp_path: Path) -> None:
    shards = write_feature_shards(tmp_path / "f", classes_per_category=[6, 6, 3], images=4, dim=16)
    vectors, labels, categories = read_split(shards, "test")
    assert vectors.shape == (5 * 4, 16) and len(set(labels.tolist())) == 5
    assert categories.tolist() == sorted(categories.tolist()) and set(categories.tolist()) == {0, 1, 2}
    result = confusion(vectors, labels, categories)
    assert result.queries == 20 and result.recall_at_1 > 0.5, "clustered synthetic vectors: mostly right"
