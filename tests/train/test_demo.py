"""The demo driver on tiny shards: baselines, 2-process training, the Recall table and its files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.training import REPO, TINY_OVERRIDES, build_tiny_shards, cpu_env


@pytest.mark.slow
@pytest.mark.distributed
def test_demo_driver_on_tiny_shards(tmp_path: Path) -> None:
    shards = build_tiny_shards(tmp_path)
    out = tmp_path / "demo"
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("eval.ks")]
    cmd = [sys.executable, "-m", "ddp_rank.cli.demo", "--out", str(out), "--shards", str(shards), "--steps", "3",
           *overrides, "eval.ks=1,10", "model.weights=none"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "demo.md").read_text()
    for row in ("raw pixels", "network before training", "network after training (3 steps)"):
        assert f"| {row}" in text
    assert "Recall@1 gain from training" in text and "R@10" in text
    # configs/demo.yaml adds the verification figures beside Recall@k, and their ROC curve.
    assert "TPR@1e-2" in text and "AUC" in text and "after training: TPR@FPR=1e-2" in text
    assert "![ROC](roc.png)" in text and (out / "roc.png").stat().st_size > 1000
    for name in ("summary.md", "loss.png", "recall.png", "metrics.jsonl"):
        assert (out / "train" / name).is_file(), name
