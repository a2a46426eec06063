"""Runs one after another in one Python process (``ddp_rank.experiments.in_process``): what a run changes
process-wide is put back (``ddp_rank.runtime.process_state``), and two different runs trained back to back in
one worker process give, bit for bit, the metrics and weights each gives alone in a fresh ``ddp-rank train``
process."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from ddp_rank.data.features.synthetic import write_feature_shards
from ddp_rank.experiments.in_process import EXIT_USAGE, RunsInProcess, train_in_worker
from ddp_rank.runtime.process_state import ProcessState

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # accelerate's import and first Accelerator: seconds in a process of its own
def test_restore_undoes_what_a_run_changes_process_wide() -> None:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)
    start = ProcessState.record()
    fresh_draw = (torch.rand(3), np.random.rand(), random.random())  # noqa: NPY002 - the global generators
    start.restore()
    logger = logging.getLogger("ddp_rank")
    handlers = list(logger.handlers)
    threads = torch.get_num_threads()
    try:
        Accelerator(cpu=True, mixed_precision="bf16")
        torch.manual_seed(5)
        np.random.seed(5)  # noqa: NPY002
        random.seed(5)
        torch.use_deterministic_algorithms(True)
        torch.set_float32_matmul_precision("medium")
        torch.set_num_threads(1)
        torch.backends.cudnn.benchmark = True
        os.environ["DDP_RANK_TEST_LEAK"] = "1"
        logger.addHandler(logging.NullHandler())
        signal.signal(signal.SIGUSR1, lambda *_: None)
        start.restore()
        assert not AcceleratorState._shared_state
        assert Accelerator(cpu=True).mixed_precision == "no"  # a new run gets its own precision
        start.restore()
        assert torch.equal(torch.rand(3), fresh_draw[0])
        assert (np.random.rand(), random.random()) == fresh_draw[1:]  # noqa: NPY002
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.get_num_threads() == threads
        assert not torch.backends.cudnn.benchmark
        assert "DDP_RANK_TEST_LEAK" not in os.environ
        assert logger.handlers == handlers
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    finally:
        os.environ.pop("DDP_RANK_TEST_LEAK", None)
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        torch.use_deterministic_algorithms(False)
        torch.set_float32_matmul_precision("highest")
        torch.set_num_threads(threads)
        AcceleratorState._reset_state(True)


def test_a_bad_config_is_one_line_and_the_usage_status(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    runs = RunsInProcess()
    assert runs.train(None, ["train.stepz=3", f"train.output_dir={tmp_path}"]) == EXIT_USAGE
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.stepz" in err[0] and "'steps'" in err[0], err


def test_runs_refuse_a_process_of_a_multi_process_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="accelerate launch"):
        RunsInProcess()


def _run(shards: Path, out: Path, *extra: str) -> list[str]:
    return [
        f"data.shards={shards}", "data.test_split=", "data.num_workers=0", "model.backbone=features",
        "model.embedding_dim=16", "train.steps=3", "train.log_every=1", "train.eval_every=0",
        "train.progress=false", "distributed.cpu=true", f"train.output_dir={out}", *extra,
    ]  # fmt: skip


def _losses(run: Path) -> list[float]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    (last,) = sorted((run / "checkpoints").glob("step-*"))
    (file,) = last.glob("model*.safetensors")
    return load_file(str(file))


@pytest.mark.slow
def test_two_runs_in_one_worker_match_each_run_alone(tmp_path: Path) -> None:
    shards = write_feature_shards(tmp_path / "shards", [6, 6, 6], images=6, dim=12, test_every=0)
    # Two different runs: another loss, batch, rate and seed, and a precision the first would leave behind.
    first = ["data.global_batch_size=24", "loss.name=fastap", "train.mixed_precision=bf16", "train.seed=1"]
    second = ["data.global_batch_size=36", "loss.name=pnp", "optim.lr=3e-3", "train.seed=2", "train.deterministic=true"]  # fmt: skip
    together = {name: tmp_path / "together" / name for name in ("a", "b")}
    alone = {name: tmp_path / "alone" / name for name in ("a", "b")}
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        statuses = [
            pool.submit(train_in_worker, None, _run(shards, together[n], *o), str(tmp_path / f"{n}.log")).result()
            for n, o in (("a", first), ("b", second))
        ]  # fmt: skip
    assert statuses == [0, 0], [(tmp_path / f"{n}.log").read_text() for n in "ab"]
    pids = {json.loads((together[n] / "run.json").read_text())["pid"] for n in "ab"}
    assert len(pids) == 1  # one process trained both
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for name, overrides in (("a", first), ("b", second)):
        subprocess.run(
            [sys.executable, "-m", "ddp_rank.cli", "train", *_run(shards, alone[name], *overrides)],
            check=True, capture_output=True, env=env,
        )  # fmt: skip
    for name in "ab":
        assert _losses(together[name]) == _losses(alone[name])
        mine, theirs = _weights(together[name]), _weights(alone[name])
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert str(together["b"]) not in (together["a"] / "train.log").read_text()  # the first log was closed
    assert (
        "loss kernel=auto" in (together["b"] / "train.log").read_text()
    )  # said once per run, not per process
