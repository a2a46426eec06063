"""The demo driver on tiny shards: baselines, 2-process training, the Recall table and its files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers.training import TINY_OVERRIDES, build_tiny_shards, cpu_env


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_driver_on_tiny_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver runs in this process (it is argument handling and the table; a process of its own would only
    import torch once more); what it starts, the baseline's evaluation and the 2-process training under
    ``accelerate launch``, are processes of their own, with the environment of a CPU job."""
    from ddp_rank.cli.demo import main

    for name, value in cpu_env().items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    shards = build_tiny_shards(tmp_path)
    out = tmp_path / "demo"
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("eval.ks")]
    # --processes 2: what the driver picks without a GPU, whatever this process sees.
    assert main(["--out", str(out), "--shards", str(shards), "--steps", "3", "--processes", "2",
                 *overrides, "eval.ks=1,10", "model.weights=none"]) == 0  # fmt: skip
    text = (out / "demo.md").read_text()
    for row in ("raw pixels", "network before training", "network after training (3 steps)"):
        assert f"| {row}" in text
    assert "Recall@1 gain from training" in text and "R@10" in text
    # configs/demo.yaml adds the verification figures beside Recall@k, and their ROC curve.
    assert "TPR@1e-2" in text and "AUC" in text and "after training: TPR@FPR=1e-2" in text
    assert "![ROC](roc.png)" in text and (out / "roc.png").stat().st_size > 1000
    for name in ("summary.md", "loss.png", "recall.png", "metrics.jsonl"):
        assert (out / "train" / name).is_file(), name
