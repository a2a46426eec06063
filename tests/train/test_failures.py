"""A failure on one rank ends the whole job promptly, with that rank's message (2 processes, accelerate launch).

Without it, the other rank would wait in the step's next collective until the process-group timeout (30 minutes
by default). tests/helpers/fail_one_rank.py injects the failure on rank 1 at its second step.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.training import REPO, TINY_OVERRIDES, build_tiny_shards, cpu_env, free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

MESSAGE = "CUDA out of memory. Tried to allocate 20.00 GiB (simulated)"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_shards(tmp_path_factory.mktemp("tiny-failures"))


def launch_failing(where: str, shards: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(REPO / "launch" / "accelerate_cpu_2proc.yaml"),
        "--main_process_port", str(free_port()),
        str(REPO / "tests" / "helpers" / "fail_one_rank.py"), where,
        *TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={out}", "train.steps=6",
        "distributed.chunk_size=0",  # the failure counts forward calls: no probe of chunk_size=auto before them
    ]  # fmt: skip
    env = cpu_env()
    t0 = time.monotonic()
    # The test's own limit is far above the requirement (about a minute) and far below the 30-minute collective
    # timeout that a hung rank would wait for.
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    return proc, time.monotonic() - t0


def test_an_exception_in_one_ranks_forward_ends_every_rank(shards: Path, tmp_path: Path) -> None:
    """Rank 1 fails before the step's collectives; rank 0 is already waiting in the global loss."""
    proc, seconds = launch_failing("forward", shards, tmp_path / "run")
    assert proc.returncode != 0
    mine = [line for line in proc.stderr.splitlines() if line.startswith("ddp-rank train: error on rank 1")]
    assert mine == [f"ddp-rank train: error on rank 1 at step 2: RuntimeError: {MESSAGE}"], proc.stderr[-3000:]
    assert seconds < 90, f"the job took {seconds:.0f} s to end"


def test_an_exception_inside_the_global_loss_is_raised_on_every_rank(shards: Path, tmp_path: Path) -> None:
    """Rank 1 fails inside the loss: the loss layer shares it, every rank unwinds, rank 0 prints it once."""
    proc, seconds = launch_failing("loss", shards, tmp_path / "run")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ddp-rank train: error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("ddp-rank train: error: step 2: the global-batch loss failed on rank(s) [1]")
    assert MESSAGE in errors[0]
    assert seconds < 90, f"the job took {seconds:.0f} s to end"


def test_a_setup_error_is_printed_once_as_one_line(shards: Path, tmp_path: Path) -> None:
    """Every rank meets the same config error; rank 0 prints it, the launcher stops the rest."""
    from tests.helpers.training import launch

    proc = launch("train", *TINY_OVERRIDES, f"data.shards={shards}", f"train.output_dir={tmp_path / 'run'}",
                  "train.best_metric=recall@3", timeout=120)  # fmt: skip
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error" in line and "ddp-rank" in line]
    assert errors == [
        "ddp-rank train: error: train.best_metric='recall@3' is not among the metrics eval.protocol=sop reports "
        "with these settings; valid: recall@1, recall@2, map@r"
    ], proc.stderr[-3000:]
