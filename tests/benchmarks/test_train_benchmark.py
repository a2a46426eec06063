"""benchmarks/train.py's bare gradient-cache reference and captured rows, and the ``train`` targets on them: the
plan of configurations, the verdicts from recorded rows, and the whole script in small form on the CPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import train as train_bench
from benchmarks.acceptance import gpu_targets as targets
from tests.benchmarks.acceptance.test_gpu_check import REPO, _status
from tests.helpers.training import cpu_env


def _args(**kw: Any) -> argparse.Namespace:
    defaults = {"batch": 256, "chunk": [64, 32, 128], "capture": "graphs", "capture_chunks": [32],
                "deterministic": True}  # fmt: skip
    return argparse.Namespace(**{**defaults, **kw})


def test_the_plan_holds_both_references_at_every_chunk_and_the_captured_chunk() -> None:
    plan = train_bench.build_plan(_args(), [1])
    assert plan == [
        ("bare", 1, 0, False),
        ("gradcache", 1, 64, False), ("gradcache", 1, 32, False), ("gradcache", 1, 128, False),
        ("trainer", 1, 0, False),
        ("trainer", 1, 64, False), ("trainer", 1, 32, False), ("trainer", 1, 128, False),
        ("captured", 1, 32, False),
        ("bare", 1, 0, True), ("trainer", 1, 0, True), ("trainer", 1, 64, True),
    ]  # fmt: skip
    # A chunk that holds the whole local batch would be the direct step again: no row for it.
    small = train_bench.build_plan(_args(batch=64, capture="none", deterministic=False), [1, 2])
    assert small == [("bare", 1, 0, False), ("gradcache", 1, 32, False), ("trainer", 1, 0, False),
                     ("trainer", 1, 32, False), ("trainer", 2, 0, False)]  # fmt: skip


def _row(mode: str, step_s: float, **extra: Any) -> dict[str, Any]:
    return {
        "mode": mode,
        "processes": 1,
        "deterministic": False,
        "step_s": step_s,
        "global_batch": 256,
        **extra,
    }


def test_targets_compare_the_chunked_step_with_the_bare_gradient_cache_and_the_captured_chunk() -> None:
    rows = [
        _row("bare loop", 1.0), _row("direct", 1.05),
        _row("bare gradient cache (64)", 1.3), _row("chunked (64)", 1.35),  # 96% of the cache, 74% of the loop
        _row("bare gradient cache (32)", 1.5), _row("chunked (32)", 3.0),
        _row("chunked (32), captured (graphs)", 1.6, compile_s={"pass 1": 40.0, "pass 2": 70.0}),  # 62%
    ]  # fmt: skip
    verdicts = targets.train_verdicts(rows)
    assert _status(verdicts, "trainer chunked (64) >= 70% of the bare loop") == targets.PASS
    assert _status(verdicts, "trainer chunked (64) >= 95% of the bare gradient cache (64)") == targets.PASS
    captured = next(v for v in verdicts if v.target.startswith("trainer chunked (32), captured >= 60%"))
    assert captured.status == targets.PASS and "compile time 40.0 + 70.0 s" in captured.detail
    assert _status(verdicts, "trainer chunked (32) against the bare loop") == targets.INFO
    assert _status(verdicts, "trainer chunked (32) against the bare gradient cache (32)") == targets.INFO
    slower = [*rows[:3], _row("chunked (64)", 1.45), _row("chunked (32), captured (graphs)", 1.8)]
    verdicts = targets.train_verdicts(slower)
    assert _status(verdicts, "trainer chunked (64) >= 95% of the bare gradient cache") == targets.FAIL  # 90%
    assert _status(verdicts, "trainer chunked (32), captured >= 60%") == targets.FAIL  # 56%
    # Without the reference rows (an older benchmark) the new targets are not measured, never passed.
    old = targets.train_verdicts([*rows[:2], rows[3]])
    assert _status(old, "bare gradient cache (64)") == targets.NOT_MEASURED
    assert _status(old, "captured >= 60%") == targets.NOT_MEASURED
    crashed = targets.train_verdicts([*rows[:6], {**rows[6], "error": "exit 1: Unsupported"}])
    assert _status(crashed, "captured >= 60%") == targets.FAIL


def test_the_table_sets_each_chunked_row_against_the_gradient_cache_of_its_chunk() -> None:
    common = {
        "chunks": 2,
        "total_s": 1.0,
        "data_s": 0.0,
        "loss_s": float("nan"),
        "comm_s": 0.0,
        "comm_bytes": 0,
    }
    rows = [_row("bare loop", 1.0, chunk=0, **common), _row("bare gradient cache (64)", 1.2, chunk=64, **common),
            _row("chunked (64)", 1.5, chunk=64, **common),
            _row("chunked (64), captured (graphs)", 1.25, chunk=64, compile_s={"pass 1": 3.0}, **common)]  # fmt: skip
    lines = train_bench.table(rows).splitlines()
    assert "| vs bare loop | vs bare gradient cache |" in lines[0]
    assert "| 1 | chunked (64) | no | 170.7 | 67% | 80% |" in lines[4]
    assert lines[5].startswith("| 1 | chunked (64), captured (graphs) | no | 204.8 | 80% | 96% |")
    assert lines[5].endswith("| 3.0 |")


@pytest.mark.slow
def test_the_benchmark_runs_on_the_cpu_in_small_form(tmp_path: Path) -> None:
    """A tiny CNN at 16 px: the bare loop, the bare gradient cache, the trainer direct and chunked, and the
    captured chunk (aot_eager: the capture without generating code), each in its own process."""
    out, report = tmp_path / "rows.json", tmp_path / "train.md"
    cmd = [sys.executable, "-m", "benchmarks.train", "--device", "cpu", "--backbone", "tiny_cnn", "--image-size", "16",
           "--batch", "16", "--chunk", "8", "--capture", "compile", "--compiler", "aot_eager", "--processes", "1",
           "--steps", "1", "--warmup", "1", "--repeats", "1", "--json", str(out), "--output", str(report)]  # fmt: skip
    env = {**cpu_env(), "PYTHONPATH": str(REPO)}  # this checkout's ddp_rank in the script's jobs
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == [
        "bare loop", "bare gradient cache (8)", "direct", "chunked (8)", "chunked (8), captured (compile)"
    ]  # fmt: skip
    assert all("error" not in r and r["step_s"] > 0 for r in rows)
    assert rows[1]["chunks"] == rows[3]["chunks"] == rows[4]["chunks"] == 2
    assert set(rows[4]["compile_s"]) == {"pass 1", "pass 2"}
    assert "vs bare gradient cache" in report.read_text()
