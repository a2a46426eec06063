"""Stopping on a signal loses nothing: every rank stops after the same step with a checkpoint, exits 75, and the
resumed run ends with exactly the weights of an uninterrupted one, no step lost or repeated (2 gloo processes
under ``accelerate launch``; the signal reaches rank 1 only, in the middle of a chunked step, an evaluation or a
checkpoint write). The stop request itself: a second signal or the grace period ends the process at once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddp_rank.train.preemption import EXIT_REQUEUE, StopRequest
from tests.helpers.training import (
    REPO,
    TINY_OVERRIDES,
    build_tiny_shards,
    cpu_env,
    final_weights,
    free_port,
    launch,
)

STEPS = 6
RUN = [*TINY_OVERRIDES, f"train.steps={STEPS}", "distributed.chunk_size=3", "train.eval_every=2",
       "train.checkpoint_every=2", "train.keep_last=10"]  # fmt: skip


# ----------------------------------------------------------------------------------------- the stop request
def test_a_signal_becomes_a_request_and_a_repeat_within_the_debounce_is_the_same_one() -> None:
    exits: list[int] = []
    stop = StopRequest(["SIGUSR2"], debounce_s=60, exit_fn=exits.append).install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested and stop.received == signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGUSR2)  # a launcher forwarding the same signal
        assert exits == []
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_a_second_signal_exits_at_once() -> None:
    exits: list[int] = []
    stop = StopRequest(["SIGUSR2"], debounce_s=0, exit_fn=exits.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert exits == [EXIT_REQUEUE]
    finally:
        stop.restore()


def test_the_grace_period_running_out_exits_unless_the_stop_is_done() -> None:
    exits: list[int] = []
    stop = StopRequest(["SIGUSR2"], grace_s=0.2, exit_fn=exits.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.5)
        assert exits == [EXIT_REQUEUE]
    finally:
        stop.restore()
    exits.clear()
    stop = StopRequest(["SIGUSR2"], grace_s=0.2, exit_fn=exits.append).install()
    try:
        os.kill(os.getpid(), signal.SIGUSR2)
        stop.done()  # the checkpoint was written in time
        time.sleep(0.4)
        assert exits == []
    finally:
        stop.restore()


def test_stop_signals_are_checked_in_the_config() -> None:
    from ddp_rank.config import ConfigError, load_config

    assert load_config(None, ["train.stop_signals=SIGUSR1"]).train.stop_signals == ["SIGUSR1"]
    with pytest.raises(ConfigError, match=r"train\.stop_signals='SIGKILL' is not a valid choice"):
        load_config(None, ["train.stop_signals=SIGKILL"])


# ----------------------------------------------------------------------------------------- 2 processes
@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny-preemption"))


@pytest.fixture(scope="module")
def uninterrupted(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "uninterrupted"
    proc = launch("train", f"data.shards={shards}", f"train.output_dir={out}", *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def _launch_signalled(phase: str, step: int, sig: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "launch" / "accelerate_cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        str(REPO / "tests" / "helpers" / "signal_one_rank.py"), phase, str(step), sig, *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=cpu_env(), cwd=REPO)


def _train_steps(run: Path) -> list[int]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("phase", "at", "sig", "stopped_after"),
    [
        ("step", 3, "SIGUSR1", 4),  # inside step 3's chunked forward-backward: the agreement of step 4 sees it
        ("eval", 2, "SIGTERM", 3),  # inside the evaluation after step 2
        ("checkpoint", 2, "SIGUSR1", 3),  # while step 2's checkpoint is written
    ],
)
def test_a_signal_stops_every_rank_with_a_checkpoint_and_the_resume_loses_nothing(
    shards: Path, uninterrupted: Path, tmp_path: Path, phase: str, at: int, sig: str, stopped_after: int
) -> None:
    run = tmp_path / "run"
    common = [f"data.shards={shards}", f"train.output_dir={run}", *RUN]
    proc = _launch_signalled(phase, at, sig, *common)
    # torchrun reports the ranks' status 75 as a failure of its own (requeueing is the trainer's job), and once
    # the first rank has exited it ends the other, which may still be tearing down after the checkpoint: 75 or
    # SIGTERM (-15), nothing else.
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert proc.returncode != 0 and "75" in codes and set(codes) <= {"75", "-15"}, proc.stderr[-3000:]
    assert f"received {sig}" in proc.stderr and f"stopped after step {stopped_after} of {STEPS}" in proc.stderr, (
        proc.stderr[-3000:]
    )
    assert (run / "checkpoints" / f"step-{stopped_after:08d}" / "meta.json").is_file()
    assert _train_steps(run) == list(range(1, stopped_after + 1))
    assert not (run / "summary.md").exists(), "a stopped run is not a finished one"

    resumed = launch("train", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped_after:08d}'}" in resumed.stdout
    assert _train_steps(run) == list(range(1, STEPS + 1)), "no step lost or repeated"
    mine, reference = final_weights(run), final_weights(uninterrupted)
    assert mine.keys() == reference.keys()
    for name in reference:
        assert torch.equal(mine[name], reference[name]), name


def test_a_single_process_run_exits_with_the_requeue_status(shards: Path, tmp_path: Path) -> None:
    """Without a launcher in between, the process's own exit status is 75 (EX_TEMPFAIL)."""
    cmd = [sys.executable, str(REPO / "tests" / "helpers" / "signal_one_rank.py"), "step", "2", "SIGTERM",
           f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", *RUN]  # fmt: skip
    env = {**cpu_env(), "RANK": "1"}  # the helper signals rank 1; one process, so this is the whole run
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == EXIT_REQUEUE, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / "meta.json").is_file()
