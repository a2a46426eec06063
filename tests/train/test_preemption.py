"""Stopping on a signal loses nothing: every rank stops after the same step with a checkpoint, exits 75, and the
resumed run ends with exactly the weights of an uninterrupted one, no step lost or repeated (2 gloo processes
under ``accelerate launch``; the signal reaches rank 1 only, in the middle of a chunked step, an evaluation or a
checkpoint write, one run stopped in each phase in turn; and one process whose whole process group, DataLoader workers included, is signalled). Under
SLURM the job is requeued only once the stop is recorded. The stop request itself: a second signal or the grace
period ends the process at once."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ddp_rank.data.reading.loader import STOP_SIGNALS, ignore_stop_signals
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

STEPS = 10
# No PNGs (a finished run's plots, each evaluation's retrieval picture): the stops and resumes are what is checked.
RUN = [*TINY_OVERRIDES, f"train.steps={STEPS}", "distributed.chunk_size=3", "train.eval_every=2",
       "train.checkpoint_every=2", "train.keep_last=10", "train.plots=false", "eval.grid_queries=0"]  # fmt: skip


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


# ----------------------------------------------------------------------------------------- DataLoader workers
class _Ignored(IterableDataset):
    """Yields, from the DataLoader worker that iterates it, which of ``names`` that worker ignores."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = names

    def __iter__(self) -> Iterator[dict[str, bool]]:
        yield {name: signal.getsignal(signal.Signals[name]) == signal.SIG_IGN for name in self.names}


def test_dataloader_workers_ignore_every_signal_that_can_stop_a_run() -> None:
    """A scheduler and a launcher signal the workers too; what to do is the main process's decision."""
    from ddp_rank.config import TrainConfig
    from ddp_rank.config.checks import field_choices

    choices = field_choices(TrainConfig, "stop_signals") or ()
    assert set(choices) <= set(STOP_SIGNALS)
    workers = DataLoader(
        _Ignored(choices), batch_size=None, num_workers=1, worker_init_fn=ignore_stop_signals
    )
    assert next(iter(workers)) == dict.fromkeys(choices, True)
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # in the worker only


def test_the_export_readers_workers_ignore_the_stop_signals(
    shards: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ddp-rank export`` / ``search`` read a split with their own DataLoader (the training and evaluation
    loaders: test_dataloader_workers_ignore_a_signal_to_the_whole_process_group)."""
    from ddp_rank.data.reading.transforms import TransformConfig
    from ddp_rank.eval import sources

    made: list[dict[str, Any]] = []

    class Recorded(DataLoader):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(sources, "DataLoader", Recorded)
    batch = next(sources.split_batches(shards, "test", TransformConfig(resize=16, crop=16), 4, 0, 1, 1))
    assert len(batch.keys) == 4 and made[0]["worker_init_fn"] is ignore_stop_signals


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


def _launch_signalled(
    phase: str, step: int, sig: str, *args: str, env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "launch" / "accelerate_cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        str(REPO / "tests" / "helpers" / "signal_one_rank.py"), phase, str(step), sig, *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _train_steps(run: Path) -> list[int]:
    return [r["step"] for r in _records(run, "train")]


def _fake_scontrol(where: Path, run: Path) -> dict[str, str]:
    """The environment of a SLURM job whose ``scontrol`` (first on PATH) records, when it is called, its
    arguments and the run as it is then (``run.json`` and ``metrics.jsonl`` copied to ``where``), then sends
    SIGTERM to its caller, as a requeue makes SLURM signal the whole job."""
    where.mkdir()
    script = where / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$*" >> {shlex.quote(str(where / "calls"))}\n'
        f"cp {shlex.quote(str(run / 'run.json'))} {shlex.quote(str(run / 'metrics.jsonl'))} "
        f"{shlex.quote(str(where))}\n"
        "kill -TERM $PPID\n"
    )
    script.chmod(0o755)
    return {**cpu_env(), "PATH": f"{where}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def _assert_requeued_after_the_stop_was_recorded(where: Path, *stops: int) -> None:
    """Rank 0 asked once, and only once the stop record and run.json's "stopped" were written (a requeue makes
    SLURM signal the whole job). ``stops``: the steps of the run's stop records by then, this stop's last (a
    resumed run keeps the records of the steps up to its checkpoint, earlier stops' included)."""
    assert (where / "calls").read_text().splitlines() == ["requeue 4242"]
    assert json.loads((where / "run.json").read_text())["status"] == "stopped"
    assert [r["step"] for r in _records(where, "stop")] == list(stops)


# Each stop is resumed by the next signalled run, the last by a plain one: every stage is a stop of its own phase
# (the signal reaches rank 1 only) and the resume of the stop before it, and the run ends with the weights of an
# uninterrupted one. (phase, step of the phase, signal, the step every rank stops after)
STAGES = [
    ("step", 3, "SIGUSR1", 4),  # inside step 3's chunked forward-backward: the agreement of step 4 sees it
    ("eval", 6, "SIGTERM", 7),  # inside the evaluation after step 6
    ("checkpoint", 8, "SIGUSR1", 9),  # while step 8's checkpoint is written
]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_signal_stops_every_rank_with_a_checkpoint_and_the_resume_loses_nothing(
    shards: Path, uninterrupted: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    common = [f"data.shards={shards}", f"train.output_dir={run}", *RUN]
    resumed_from = None
    for stage, (phase, at, sig, stopped_after) in enumerate(STAGES):
        where = f"{phase} {at} ({sig})"
        slurm = _fake_scontrol(tmp_path / f"slurm-{stage}", run)
        proc = _launch_signalled(phase, at, sig, *common, env=slurm)
        # torchrun reports the ranks' status 75 as a failure of its own (requeueing is the trainer's job), and
        # once the first rank has exited it ends the other, which may still be tearing down after the
        # checkpoint: 75 or SIGTERM (-15), nothing else.
        codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
        failure = (where, proc.stderr[-3000:])
        assert proc.returncode != 0 and "75" in codes and set(codes) <= {"75", "-15"}, failure
        if resumed_from is not None:
            assert f"resumed from {resumed_from}" in proc.stdout, (where, proc.stdout[-3000:])
        stopped = f"stopped after step {stopped_after} of {STEPS}"
        assert f"received {sig}" in proc.stderr and stopped in proc.stderr, failure
        resumed_from = run / "checkpoints" / f"step-{stopped_after:08d}"
        assert (resumed_from / "meta.json").is_file(), where
        assert _train_steps(run) == list(range(1, stopped_after + 1)), where
        assert not (run / "summary.md").exists(), "a stopped run is not a finished one"
        stops = [stop for *_, stop in STAGES[: stage + 1]]
        _assert_requeued_after_the_stop_was_recorded(tmp_path / f"slurm-{stage}", *stops)

    resumed = launch("train", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {resumed_from}" in resumed.stdout
    assert _train_steps(run) == list(range(1, STEPS + 1)), "no step lost or repeated"
    mine, reference = final_weights(run), final_weights(uninterrupted)
    assert mine.keys() == reference.keys()
    for name in reference:
        assert torch.equal(mine[name], reference[name]), name


@pytest.mark.slow
def test_a_single_process_run_exits_with_the_requeue_status(shards: Path, tmp_path: Path) -> None:
    """Without a launcher in between, the process's own exit status is 75 (EX_TEMPFAIL)."""
    cmd = [sys.executable, str(REPO / "tests" / "helpers" / "signal_one_rank.py"), "step", "2", "SIGTERM",
           f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}", *RUN]  # fmt: skip
    env = {**cpu_env(), "RANK": "1"}  # the helper signals rank 1; one process, so this is the whole run
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == EXIT_REQUEUE, proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-00000003" / "meta.json").is_file()


def test_a_signal_during_the_start_up_stops_the_run_after_its_first_step(
    shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signals are taken over before the trainer is built (shards, model, the chunk's probe can take minutes):
    a signal then is a stop request like any other, met after step 1 with its checkpoint, not a killed process."""
    from ddp_rank.config import load_config
    from ddp_rank.train import trainer as trainer_module

    build_stream = trainer_module.build_stream

    def build_stream_and_get_signalled(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGUSR2)  # the scheduler's signal, in the middle of the start-up
        return build_stream(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "build_stream", build_stream_and_get_signalled)
    out = tmp_path / "run"
    cfg = load_config(
        None, [*RUN, f"data.shards={shards}", f"train.output_dir={out}", "train.stop_signals=SIGUSR2"]
    )
    with pytest.raises(trainer_module.RunStopped) as stopped:
        trainer_module.run_training(cfg)
    assert stopped.value.step == 1
    assert (out / "checkpoints" / "step-00000001" / "meta.json").is_file()
    assert json.loads((out / "run.json").read_text())["status"] == "stopped"
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # given back after the run


def _start(log: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``python ARGS`` in a session of its own (so its process group is it and its DataLoader workers); stdout
    and stderr to ``log``.out / .err."""
    with open(log.with_suffix(".out"), "wb") as out, open(log.with_suffix(".err"), "wb") as err:
        return subprocess.Popen(
            [sys.executable, *args],
            stdout=out,
            stderr=err,
            env=env or cpu_env(),
            cwd=REPO,
            start_new_session=True,
        )


def _train_here(*args: str) -> int:
    """``ddp-rank train ARGS`` in this process, on one thread as the subprocesses of cpu_env() run (so that its
    steps are bit-for-bit those of a subprocess's): the uninterrupted reference and the resume of a run stopped
    in a process of its own, which only the stopped run needs to be."""
    from ddp_rank.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["train", *args])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_dataloader_workers_ignore_a_signal_to_the_whole_process_group(shards: Path, tmp_path: Path) -> None:
    """SLURM signals every process of a job and torchrun each rank's process group: the DataLoader workers get
    the signal too. SIGUSR1 then SIGTERM (a time limit's warning, then the kill) reach the process group of a run
    with 2 workers during an evaluation, with the training loader's workers and the evaluation's running. The
    workers ignore them (torch's would die of the SIGTERM, and inherit the SIGUSR1 handler): the run stops once,
    with a checkpoint and status 75, and resumes to the weights of an uninterrupted run (the resume and the
    uninterrupted run in this process: the signal to a process group is the stopped run's alone)."""
    common = [f"data.shards={shards}", *RUN, "data.num_workers=2"]
    run, reference, ready = tmp_path / "run", tmp_path / "reference", tmp_path / "ready"
    slurm = _fake_scontrol(tmp_path / "slurm", run)
    helper = str(REPO / "tests" / "helpers" / "await_signal_in_evaluation.py")
    stopped = _start(run, helper, "2", str(ready), *common, f"train.output_dir={run}", env=slurm)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert stopped.poll() is None, run.with_suffix(".err").read_text()[-3000:]
        assert time.monotonic() < deadline, "the run never reached the evaluation after step 2"
        time.sleep(0.05)
    os.killpg(stopped.pid, signal.SIGUSR1)
    os.killpg(stopped.pid, signal.SIGTERM)
    code = stopped.wait(120)
    stderr = run.with_suffix(".err").read_text()
    assert code == EXIT_REQUEUE, stderr[-3000:]
    assert stderr.count("received SIG") == 1, stderr[-3000:]  # the main process's; none from a worker
    assert (run / "checkpoints" / "step-00000003" / "meta.json").is_file()
    _assert_requeued_after_the_stop_was_recorded(tmp_path / "slurm", 3)

    assert _train_here(*common, f"train.output_dir={run}") == 0  # the resume
    assert _train_here(*common, f"train.output_dir={reference}") == 0  # uninterrupted
    assert _train_steps(run) == list(range(1, STEPS + 1)), "no step lost or repeated"
    mine, expected = final_weights(run), final_weights(reference)
    assert mine.keys() == expected.keys()
    for name in expected:
        assert torch.equal(mine[name], expected[name]), name
