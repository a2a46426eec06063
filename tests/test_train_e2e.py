"""End-to-end on CPU: 2 gloo processes under `accelerate launch` with launch/accelerate_cpu_2proc.yaml.

A direct and a chunked run write checkpoints, metrics, plots and the summary; a run killed with SIGKILL in the
middle resumes from its last complete checkpoint and ends with exactly the parameters of an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from train_helpers import REPO, TINY_OVERRIDES, accelerate_cmd, build_tiny_shards, final_weights, launch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 40
RUN = [*TINY_OVERRIDES, f"train.steps={STEPS}", "train.checkpoint_every=1", "train.keep_last=2",
       "train.eval_every=20", "train.eval_at_start=true"]  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny-e2e"))


@pytest.fixture(scope="module")
def uninterrupted(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "uninterrupted"
    proc = launch("train", f"data.shards={shards}", f"train.output_dir={out}", *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_direct_run_writes_everything(uninterrupted: Path) -> None:
    run = uninterrupted
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "recall.png", "summary.md"):
        assert (run / name).is_file(), name
    recs = records(run)
    train = [r for r in recs if r["kind"] == "train"]
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["chunks"] == 1 for r in train)
    assert [r["step"] for r in evals] == [0, 20, 40]
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    assert {"step-00000039", "step-00000040"} <= set(ckpts) and best["path"] in ckpts
    meta = json.loads((run / "checkpoints" / "step-00000040" / "meta.json").read_text())
    assert meta["world_size"] == 2 and meta["step"] == STEPS
    summary = (run / "summary.md").read_text()
    assert "2 (MULTI_CPU" in summary and "16 (8 per rank)" in summary and "![loss](loss.png)" in summary


def test_killed_run_resumes_to_the_same_parameters(shards: Path, uninterrupted: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    args = ["train", f"data.shards={shards}", f"train.output_dir={out}", *RUN]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(accelerate_cmd(*args), cwd=REPO, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    marker = out / "checkpoints" / "step-00000005" / "meta.json"
    deadline = time.time() + 240
    while not marker.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, wherever they are
    proc.wait()
    killed_at = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    assert killed_at < STEPS, "the run finished before the kill; the test needs a slower run"

    resumed = launch(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in (out / "summary.md").read_text()
    train_steps = [r["step"] for r in records(out) if r["kind"] == "train"]
    assert train_steps == list(range(1, STEPS + 1))  # the killed run's extra lines were dropped
    a, b = final_weights(uninterrupted, STEPS), final_weights(out, STEPS)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)


def test_chunked_run(shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "chunked"
    proc = launch("train", f"data.shards={shards}", f"train.output_dir={out}", *TINY_OVERRIDES,
                  "train.steps=4", "distributed.chunk_size=3", "train.checkpoint_every=2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = [r for r in records(out) if r["kind"] == "train"]
    assert [r["chunks"] for r in train] == [3, 3, 3, 3]  # 8 images per rank in chunks of 3, 3, 2
    assert (out / "checkpoints" / "step-00000004" / "meta.json").is_file()
    assert (out / "loss.png").is_file() and "chunked, chunk 3" in (out / "summary.md").read_text()


def test_world_size_change_is_refused(
    shards: Path, uninterrupted: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddp_rank.cli import main

    # The uninterrupted run was written by 2 processes; this pytest process is 1.
    args = [
        "train",
        f"data.shards={shards}",
        f"train.output_dir={uninterrupted}",
        *RUN,
        f"train.steps={STEPS + 1}",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "written by 2 process(es) but this run has 1" in err and "train.force_resume=true" in err
    # Forced, the 1-process run continues the 2-process checkpoint for the one extra step.
    assert main([*args, "train.force_resume=true", "train.eval_every=1000"]) == 0
    meta = json.loads((uninterrupted / "checkpoints" / f"step-{STEPS + 1:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["step"] == STEPS + 1
