"""A stand-in for SLURM's ``srun`` on one machine: ``python fake_srun.py [--option=value ...] COMMAND ...``.

It records its options, the command and the job's launch variables to ``$FAKE_SLURM_DIR/srun.json``, then runs
the command once per "node" (``SLURM_NNODES`` copies, each with its own ``SLURM_NODEID`` / ``SLURM_PROCID``, in a
session of its own as SLURM's tasks are). A SIGUSR1 or SIGTERM it receives goes to every task's process group, as
SLURM signals every process of a step; ``--kill-on-bad-exit=1`` ends the other tasks once one fails. It exits
with the first non-zero status of a task (0 when all succeed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

RECORDED_ENV = ("MAIN_IP", "MAIN_PORT", "GPUS_PER_NODE", "MIXED_PRECISION", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
                "PET_SIGNALS_TO_HANDLE")  # fmt: skip


def main(argv: list[str]) -> int:
    options = []
    while argv and argv[0].startswith("--"):
        options.append(argv.pop(0))
    record = {"options": options, "command": argv, "env": {k: os.environ.get(k) for k in RECORDED_ENV}}
    Path(os.environ["FAKE_SLURM_DIR"], "srun.json").write_text(json.dumps(record))

    def task_env(node: int) -> dict[str, str]:
        return {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}

    nodes = range(int(os.environ["SLURM_NNODES"]))
    tasks = [subprocess.Popen(argv, env=task_env(node), start_new_session=True) for node in nodes]

    def forward(signum: int, frame: object) -> None:
        for task in tasks:
            if task.poll() is None:
                os.killpg(task.pid, signum)

    signal.signal(signal.SIGUSR1, forward)
    signal.signal(signal.SIGTERM, forward)
    kill_on_bad_exit = "--kill-on-bad-exit=1" in options
    while any(task.poll() is None for task in tasks):
        if kill_on_bad_exit and any(task.poll() not in (None, 0) for task in tasks):
            forward(signal.SIGKILL, None)
        time.sleep(0.1)
    return next((task.returncode for task in tasks if task.returncode), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
