"""The category schedule and the packing rules: pure functions, checked exhaustively or with hypothesis."""

from __future__ import annotations

import math
from collections import Counter
from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddp_rank.data.manifest import ShardInfo
from ddp_rank.data.packing import ClassGroup, Packer, assign_shares, best_take, share_size
from ddp_rank.data.schedule import (
    ALL,
    UNLABELLED,
    CategorySchedule,
    ScheduleConfig,
    group_quotas,
    steps_of_worker,
    virtual_worker,
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


@given(local=st.integers(1, 300), groups=st.integers(1, 4), world=st.integers(1, 8))
def test_quotas_fill_the_local_batch_and_balance_the_groups(local: int, groups: int, world: int) -> None:
    per_rank = [group_quotas(local, groups, r) for r in range(world)]
    assert all(sum(q) == local for q in per_rank)
    assert all(max(q) - min(q) <= 1 for q in per_rank)
    totals = [sum(q[i] for q in per_rank) for i in range(groups)]
    assert max(totals) - min(totals) <= min(world, groups)


@given(steps=st.integers(1, 50), workers=st.integers(1, 4), start=st.integers(0, 49))
def test_workers_cover_the_steps_round_robin(steps: int, workers: int, start: int) -> None:
    start = min(start, steps - 1)
    owned = {w: list(steps_of_worker(steps, w, workers, start)) for w in range(workers)}
    merged = [
        s for rnd in range(steps) for w in range(workers) if rnd < len(owned[w]) for s in [owned[w][rnd]]
    ]
    assert merged == list(range(start, steps)), "round-robin over workers gives the step order"
    for w in range(workers):
        assert all(s % workers == virtual_worker(w, workers, start) for s in owned[w])


@given(available=st.integers(1, 12), room=st.integers(1, 12))
def test_best_take_keeps_pieces_and_rests_valid(available: int, room: int) -> None:
    t = best_take(available, room)
    if t:
        assert 2 <= t <= min(available, room)
        assert available - t != 1 and room - t != 1
    else:
        assert all(available - x == 1 or room - x == 1 for x in range(2, min(available, room) + 1))


def _shards(layout: list[list[int]], category: int | None = 0) -> list[ShardInfo]:
    out, cid = [], 0
    for sizes in layout:
        classes = tuple((cid + i, n) for i, n in enumerate(sizes))
        cid += len(sizes)
        out.append(ShardInfo(f"s{cid}.tar", category, classes, sum(sizes), 0, ""))
    return out


@settings(max_examples=60, deadline=None)
@given(
    layout=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=5), min_size=1, max_size=8),
    slots=st.integers(1, 12),
)
def test_shares_are_disjoint_and_cover_the_group(layout: list[list[int]], slots: int) -> None:
    shards = _shards(layout)
    shares = assign_shares(shards, 0, slots)
    owned = [
        {
            (u.shard, cid)
            for u in share
            for cid, _ in shards[u.shard].classes
            if u.classes is None or cid in u.classes
        }
        for share in shares
    ]
    everything = {(i, cid) for i, s in enumerate(shards) for cid, _ in s.classes}
    assert set().union(*owned) == everything
    assert sum(len(o) for o in owned) == len(everything), "no class in two shares"
    assert sum(share_size(shards, s) for s in shares) == sum(s.samples for s in shards)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(2, 7), min_size=6, max_size=30), quota=st.integers(2, 40))
def test_packer_gives_exact_parts_of_paired_images(sizes: list[int], quota: int) -> None:
    groups = [ClassGroup(c, tuple((c, j) for j in range(n))) for c, n in enumerate(sizes)]
    total = sum(sizes)

    def endless():  # type: ignore[no-untyped-def]
        while True:
            yield from groups

    packer = Packer(endless(), share_images=total)
    for _ in range(5):
        part = packer.take(quota)
        assert len(part) == quota
        if quota <= total:
            assert len(set(part)) == quota, "no image twice in a part while the share is big enough"


def test_hard_unlabelled_rejects_a_fixed_epoch_length() -> None:
    """Its epoch visits each labelled category once; a longer override would index past the epoch's order."""
    with pytest.raises(ValueError, match="hard_unlabelled"):
        ScheduleConfig(strategy="hard_unlabelled", steps_per_epoch=10)
