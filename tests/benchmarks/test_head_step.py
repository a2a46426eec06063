"""The head-step benchmark: its bare loop trains from the trainer's config, and its target is read as stated."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import head_step
from ddp_rank.data.features.synthetic import write_feature_shards


@pytest.mark.slow
def test_the_bare_loop_runs_on_the_trainers_config(tmp_path: Path) -> None:
    shards = write_feature_shards(tmp_path / "s", [4, 4], images=4, dim=8, test_every=0)
    head_step.bare_run(shards, 16, 3, tmp_path / "run", images_per_class=4)


def test_the_target_is_1_3x_plus_3_ms_below_8192_and_1_1x_at_8192() -> None:
    # trainer, bare: 16 ms <= 1.3 * 10 + 3; 17 ms is not; at 8,192 only 1.1 x counts.
    assert head_step._columns([16.0, 17.0], [10.0, 10.0], 1024)[-1] == "1 of 2"
    assert head_step._columns([1100.0, 1101.0], [1000.0, 1000.0], 8192)[-1] == "1 of 2"
