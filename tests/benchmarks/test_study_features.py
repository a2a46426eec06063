"""benchmarks/study_features.py: the rules the word study states (flat over the last quarter, the hard sampler's
categories per batch, the paired differences), on runs and manifests made by hand."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from benchmarks.study_features import Slots, _categories_to_fill, _difference, _flat
from ddp_rank.data.manifest import ClassInfo, Manifest, SplitInfo
from ddp_rank.experiments.runs import RunSummary


def _run(curve: list[tuple[int, float]]) -> RunSummary:
    run = RunSummary(path=Path("run"), status="finished")
    run.evals = [{"kind": "eval", "step": step, "recall@1": r1} for step, r1 in curve]
    run.steps = curve[-1][0] if curve else 0
    return run


def test_flat_compares_the_last_evaluation_with_the_one_at_three_quarters() -> None:
    # evaluations every quarter: 0.75 -> 1.00 gains 0.4 points: flat at 0.5, not at 0.3
    curve = [(25, 0.40), (50, 0.50), (75, 0.600), (100, 0.604)]
    assert _flat(_run(curve), points=0.5)
    assert not _flat(_run(curve), points=0.3)
    # a falling curve is flat (it has stopped growing)
    assert _flat(_run([(50, 0.6), (100, 0.55)]), points=0.5)
    # a run extended from 100 to 200 steps: evaluations at 150 and 200 decide, the earlier ones do not
    extended = [(25, 0.1), (50, 0.2), (75, 0.3), (100, 0.35), (150, 0.50), (200, 0.52)]
    assert _flat(_run(extended), points=0.5) is False
    assert _flat(_run(extended), points=2.5)


def test_one_evaluation_is_never_flat() -> None:
    assert not _flat(_run([(100, 0.5)]), points=100.0)
    assert not _flat(_run([]), points=100.0)


def _manifest(category_images: list[int]) -> Manifest:
    """One class of ``n`` images per category."""
    classes = tuple(ClassInfo(i, f"c{i}", i) for i in range(len(category_images)))
    counts = dict(enumerate(category_images))
    split = SplitInfo("train", counts, ())
    return Manifest(tuple(f"k{i}" for i in range(len(category_images))), classes, {"train": split})


def test_hard_categories_per_batch_keep_nine_tenths_of_the_images() -> None:
    manifest = _manifest([1000, 1000, 500, 100])  # 2,600 images
    # batch 400, k = 2: shares of 200; the categories of 1000, 1000, 500 hold 2,500 >= 0.9 * 2,600
    assert _categories_to_fill(manifest, "train", 400) == 2
    # batch 2,000, k = 2: shares of 1,000: 2,000 < 2,340; k = 3: 667: still 2,000; k = 4: 500: 2,500
    assert _categories_to_fill(manifest, "train", 2000) == 4
    # all images or nothing: the number of categories when no k reaches the coverage
    assert _categories_to_fill(manifest, "train", 2000, coverage=1.0) == 4
    assert _categories_to_fill(manifest, "train", 100_000) == 4


def test_difference_is_the_paired_t_interval_in_points() -> None:
    a = {"recall@1": [0.60, 0.62]}
    b = {"recall@1": [0.50, 0.51]}
    # differences 10 and 11 points: mean 10.5, sd 0.7071, t(0.975, 1) = 12.706: half-width 6.353
    assert _difference(a, b, "recall@1") == "+10.50 [+4.15, +16.85]"
    assert _difference({"recall@1": [0.6]}, {"recall@1": [0.5]}, "recall@1") == "+10.00"


@pytest.mark.parametrize("coverage", [0.5, 0.9])
def test_categories_never_below_two(coverage: float) -> None:
    assert _categories_to_fill(_manifest([10_000, 10, 10]), "train", 8, coverage=coverage) == 2


def test_a_waiting_first_seed_run_goes_before_a_waiting_replicate() -> None:
    slots = Slots(1)
    order: list[str] = []

    def take(name: str, replicate: bool) -> None:
        with slots.held(replicate):
            order.append(name)

    with slots.held(replicate=False):  # the one slot is busy while both start waiting
        replicate = threading.Thread(target=take, args=("replicate", True))
        replicate.start()
        time.sleep(0.2)  # the replicate waits first
        urgent = threading.Thread(target=take, args=("first seed", False))
        urgent.start()
        time.sleep(0.2)
    urgent.join(5)
    replicate.join(5)
    assert order == ["first seed", "replicate"]
