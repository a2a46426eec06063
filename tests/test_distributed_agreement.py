"""Cross-rank agreement, in real gloo processes: a failure on one rank stops every rank with its message."""

from __future__ import annotations

import pytest
from distributed_harness import run_distributed

from ddp_rank.distributed.agreement import RankFailure, gather_counts, raise_if_any_failed

pytestmark = pytest.mark.distributed


def _one_rank_fails(rank: int, world: int) -> str:
    raise_if_any_failed(None)  # all well: nobody raises
    try:
        raise_if_any_failed("shard train/x.tar is gone" if rank == 1 else None)
    except RankFailure as exc:
        return str(exc)
    return "no error"


def test_a_failure_on_one_rank_is_raised_on_every_rank() -> None:
    assert run_distributed(_one_rank_fails, world_size=3) == ["rank 1: shard train/x.tar is gone"] * 3


def _counts(rank: int, world: int) -> dict:
    return gather_counts({"replaced_classes": rank + 1, "bad_shards": [f"s{rank % 2}.tar"]})


def test_counts_are_summed_and_names_merged() -> None:
    merged = run_distributed(_counts, world_size=3)
    assert merged == [{"replaced_classes": 6, "bad_shards": ["s0.tar", "s1.tar"]}] * 3


def test_without_a_process_group() -> None:
    raise_if_any_failed(None)
    with pytest.raises(RankFailure, match=r"^boom$"):
        raise_if_any_failed("boom")
    assert gather_counts({"a": 2, "b": ["x"]}) == {"a": 2, "b": ["x"]}
