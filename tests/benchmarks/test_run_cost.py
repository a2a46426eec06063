"""benchmarks/run_cost.py: its runs are valid configs with the word study's settings, and the fixed cost is
2 cost(N) - cost(2N) of each round (the figures themselves are measured by running it, never in a test)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.run_cost import CONFIG, _fixed, _study_overrides
from ddp_rank.config import load_config


def test_the_runs_have_the_study_settings_with_the_evaluation_off(tmp_path: Path) -> None:
    cfg = load_config(
        str(CONFIG), _study_overrides(tmp_path / "shards", tmp_path / "run", 10, 256, plots=False)
    )
    assert cfg.model.backbone == "features" and cfg.data.test_split == "" and cfg.train.steps == 10
    assert not cfg.train.plots and cfg.data.global_batch_size == 256


def test_the_fixed_cost_cancels_the_steps() -> None:
    # 3 s fixed + 0.5 s a step: N = 10 costs 8 s, 2N = 20 costs 13 s (wall); CPU 2 s fixed + 0.4 s a step.
    assert _fixed([((8.0, 6.0), (13.0, 10.0))], 0) == [3.0]
    assert _fixed([((8.0, 6.0), (13.0, 10.0))], 1) == [2.0]
