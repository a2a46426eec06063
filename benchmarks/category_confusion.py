"""Do a dataset's categories group the classes a frozen model confuses? Top-1 mistakes of stored vectors.

    python -m benchmarks.category_confusion runs/words/features            # the test split
    python -m benchmarks.category_confusion runs/words/features --split train

Reads feature shards (``ddp-rank shards features``), takes each vector's nearest other vector (cosine) and
reports Recall@1 and, among the queries whose nearest neighbour is of another class, the share whose neighbour is
of the query's own category, beside the share expected if mistakes fell anywhere (the wrong images of the
query's category over all wrong images, averaged over those queries). A share well above chance says the hard
sampler, which draws its batch from two categories, puts the confusable classes into one batch.
"""

from __future__ import annotations

import argparse
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ddp_rank.data.features.records import FEATURE_EXTENSION, decode_vector, feature_dim
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.retrieval import drop_self, knn_search


@dataclass(frozen=True)
class Confusion:
    """Recall@1 and where the top-1 mistakes fall (fractions in [0, 1])."""

    queries: int
    recall_at_1: float
    mistakes: int
    same_category: float
    chance: float


def nearest_other(vectors: torch.Tensor, block: int = 2048) -> torch.Tensor:
    """Index of each row's most cosine-similar other row: the evaluation's own exact search (top 2, the row itself
    dropped), in blocks of ``block`` queries."""
    x = torch.nn.functional.normalize(vectors.float(), dim=1)
    _, top = knn_search(x, x, 2, backend="torch", block=block, device="cpu")
    return drop_self(top, torch.arange(len(x)))[:, 0]


def confusion(vectors: torch.Tensor, labels: torch.Tensor, categories: torch.Tensor) -> Confusion:
    """Recall@1, and the share of top-1 mistakes inside the query's category against its chance level."""
    n = len(labels)
    nearest = nearest_other(vectors)
    wrong = labels[nearest] != labels
    class_size = torch.bincount(labels)[labels]
    category_size = torch.bincount(categories)[categories]
    # a wrong neighbour drawn at random: one of the n - class_size images of other classes, of which
    # category_size - class_size are in the query's category
    chance = ((category_size - class_size) / (n - class_size).clamp(min=1)).double()
    mistakes = int(wrong.sum())
    same = (categories[nearest] == categories) & wrong
    return Confusion(
        queries=n,
        recall_at_1=float(1 - wrong.double().mean()),
        mistakes=mistakes,
        same_category=float(same.sum()) / max(mistakes, 1),
        chance=float(chance[wrong].mean()) if mistakes else 0.0,
    )


def read_split(shards: str | Path, split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every vector of ``split`` with its class id and its class's category id (unlabelled classes: -1)."""
    manifest = Manifest.load(shards)
    dim = feature_dim(manifest)
    if dim is None:
        raise SystemExit(f"{shards}: image shards; run `ddp-rank shards features` first")
    vectors, labels = [], []
    for shard in manifest.split(split).shards:
        with tarfile.open(manifest.shard_path(shard)) as tar:
            members = {m.name: m for m in tar.getmembers()}
            for name in sorted(members):
                stem, _, ext = name.rpartition(".")
                if ext != FEATURE_EXTENSION:
                    continue
                vectors.append(decode_vector(tar.extractfile(members[name]).read(), dim))  # type: ignore[union-attr]
                labels.append(int(tar.extractfile(members[f"{stem}.cls"]).read()))  # type: ignore[union-attr]
    category = [c.category if c.category is not None else -1 for c in manifest.classes]
    label_t = torch.tensor(labels)
    # bincount needs non-negative ids: unlabelled classes (-1) become one more category of their own
    cat_t = torch.tensor([category[i] for i in labels]) % (len(manifest.categories) + 1)
    return torch.from_numpy(np.stack(vectors)), label_t, cat_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shards", help="feature shard directory")
    parser.add_argument("--split", default="test")
    args = parser.parse_args()
    vectors, labels, categories = read_split(args.shards, args.split)
    result = confusion(vectors, labels, categories)
    sizes = Counter(categories.tolist())
    print(f"{args.shards}, split {args.split}: {result.queries:,} vectors of {vectors.shape[1]}, "
          f"{len(set(labels.tolist())):,} classes in {len(sizes)} categories")  # fmt: skip
    print(f"Recall@1 {100 * result.recall_at_1:.2f}%; of the {result.mistakes:,} wrong top-1 neighbours "
          f"{100 * result.same_category:.1f}% are of the query's category (chance {100 * result.chance:.2f}%)")  # fmt: skip


if __name__ == "__main__":
    main()
