"""The category schedule: which groups each step draws, a pure function of (seed, epoch, step)."""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddp_rank.data.sampling.schedule import (
    ALL,
    UNLABELLED,
    CategorySchedule,
    ScheduleConfig,
    group_quotas,
)

SOP_SIZES = {c: 5000 for c in range(12)}


def test_sop_epoch_is_every_pair_five_times() -> None:
    schedule = CategorySchedule(ScheduleConfig(batches_per_pair=5, seed=3), SOP_SIZES, global_batch=256)
    assert schedule.steps_per_epoch == 330  # the FastAP supplement's figure
    steps = [schedule.step(0, s) for s in range(330)]
    assert Counter(steps) == {pair: 5 for pair in combinations(range(12), 2)}
    assert steps != [schedule.step(1, s) for s in range(330)], "each epoch reshuffles the order"
    again = CategorySchedule(ScheduleConfig(batches_per_pair=5, seed=3), SOP_SIZES, global_batch=256)
    assert steps == [again.step(0, s) for s in range(330)], "a pure function of (seed, epoch, step)"


def test_inshop_epoch_and_three_categories_per_batch() -> None:
    sizes = {c: 1000 for c in range(23)}
    assert CategorySchedule(ScheduleConfig(batches_per_pair=2), sizes, 256).steps_per_epoch == 506
    triple = CategorySchedule(ScheduleConfig(categories_per_batch=3, batches_per_pair=1), sizes, 256)
    assert triple.steps_per_epoch == math.comb(23, 3)
    assert all(len(set(triple.step(0, s))) == 3 for s in range(0, triple.steps_per_epoch, 97))


def test_random_set_per_step_when_epoch_length_is_given() -> None:
    sizes = {c: 100 for c in range(250)}
    schedule = CategorySchedule(ScheduleConfig(steps_per_epoch=40), sizes, 64)
    steps = [schedule.step(2, s) for s in range(40)]
    assert all(len(set(s)) == 2 for s in steps) and len(set(steps)) > 30
    assert steps == [schedule.step(2, s) for s in range(40)]


def test_hard_unlabelled_follows_vehicleid_rule() -> None:
    schedule = CategorySchedule(
        ScheduleConfig(strategy="hard_unlabelled"), {0: 100, 1: 33}, 64, unlabelled_size=500
    )
    assert schedule.steps_per_epoch == 4 + 2  # ceil(100 / 32) + ceil(33 / 32)
    steps = Counter(schedule.step(0, s) for s in range(6))
    assert steps == {(0, UNLABELLED): 4, (1, UNLABELLED): 2}


def test_random_strategy_epoch_length() -> None:
    schedule = CategorySchedule(ScheduleConfig(strategy="random"), {0: 100, 1: 60}, 32, unlabelled_size=10)
    assert schedule.steps_per_epoch == 170 // 32
    assert schedule.step(0, 0) == (ALL,)


def test_bad_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="only 1 can fill"):
        CategorySchedule(ScheduleConfig(), {0: 10}, 8)
    with pytest.raises(ValueError, match="unlabelled"):
        CategorySchedule(ScheduleConfig(strategy="hard_unlabelled"), {0: 10}, 8)
    with pytest.raises(ValueError, match="strategy"):
        ScheduleConfig(strategy="easy")  # type: ignore[arg-type]
    with pytest.raises(IndexError):
        CategorySchedule(ScheduleConfig(batches_per_pair=1), {0: 9, 1: 9}, 8).step(0, 1)


@given(batch=st.integers(2, 3000), groups=st.integers(1, 4))
def test_quotas_fill_the_global_batch_and_rotate(batch: int, groups: int) -> None:
    per_step = [group_quotas(batch, groups, s) for s in range(groups)]
    assert all(sum(q) == batch and max(q) - min(q) <= 1 for q in per_step)
    totals = [sum(q[i] for q in per_step) for i in range(groups)]
    assert max(totals) == min(totals), "over `groups` steps every group gives the same number of images"


def test_pk_steps_follow_the_whole_split_or_the_categories() -> None:
    flat = CategorySchedule(ScheduleConfig(strategy="pk"), {0: 100, 1: 60}, 32, total_size=160)
    assert flat.steps_per_epoch == 5 and flat.step(0, 3) == (ALL,) and flat.group_count == 1
    aware = CategorySchedule(
        ScheduleConfig(strategy="pk", category_aware=True, batches_per_pair=2), {0: 100, 1: 60, 2: 70}, 32
    )
    assert aware.steps_per_epoch == 3 * 2 and all(len(aware.step(0, s)) == 2 for s in range(6))
    with pytest.raises(ValueError, match="images_per_class"):
        ScheduleConfig(strategy="pk", images_per_class=1)


def test_hard_unlabelled_rejects_a_fixed_epoch_length() -> None:
    """Its epoch visits each labelled category once; a longer override would index past the epoch's order."""
    with pytest.raises(ValueError, match="hard_unlabelled"):
        ScheduleConfig(strategy="hard_unlabelled", steps_per_epoch=10)
