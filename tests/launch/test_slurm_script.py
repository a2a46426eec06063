"""``launch/slurm_multinode.sbatch`` run as SLURM would run it, on one machine: a fake ``srun`` starts one task per
"node" (tests/helpers/fake_srun.py) and a fake ``scontrol`` names the nodes and records a requeue. What is
checked is the script's own launch line: the CPUs it hands to ``srun``, the port it derives from the job, the
overrides it passes on (spaces and quotes intact), the launcher check it runs first, and that a SIGUSR1 to the
job reaches the ranks, which stop with a checkpoint and requeue the job."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddp_rank.runtime.launcher_check import shutdown_timeout_problem
from tests.helpers.training import REPO, TINY_OVERRIDES, build_tiny_shards, cpu_env, free_port

SCRIPT = REPO / "launch" / "slurm_multinode.sbatch"
TRICKY = ["train.output_dir={out}/run's dir", 'data.cache_dir={out}/a "quoted" cache']


def _shim(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def _job(tmp_path: Path, *, accelerate: str | None = None, python: str | None = None) -> dict[str, str]:
    """The environment of a 2-node job whose srun, scontrol (and, when given, accelerate and python) are fakes
    in ``tmp_path / "bin"``; the fakes write what they saw to ``tmp_path / "slurm"``."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "slurm"
    bin_dir.mkdir()
    seen.mkdir()
    py = shlex.quote(sys.executable)
    _shim(
        bin_dir / "srun", f'exec {py} {shlex.quote(str(REPO / "tests" / "helpers" / "fake_srun.py"))} "$@"\n'
    )
    _shim(
        bin_dir / "scontrol",
        # A long node list, more than a pipe holds: a script that keeps only the first line must not die of it.
        f'case "$1" in show) echo 127.0.0.1; seq -f "node%g" 2 20000;; '
        f'*) echo "$*" >> {shlex.quote(str(seen / "calls"))};; esac\n',
    )
    _shim(bin_dir / "python", python or f'exec {py} "$@"\n')
    if accelerate is not None:
        _shim(bin_dir / "accelerate", accelerate)
    return {
        **cpu_env(),
        "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "FAKE_SLURM_DIR": str(seen),
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_GPUS_ON_NODE": "1",
        "SLURM_CPUS_PER_TASK": "3",
    }


def _sbatch(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)  # fmt: skip


@pytest.mark.slow
def test_the_launch_line_gives_cpus_a_job_port_and_the_overrides_intact(tmp_path: Path) -> None:
    # accelerate is a fake that writes, per node, the arguments it got and whether SIGUSR1 is ignored.
    recorder = (
        "import json, os, signal, sys\n"
        "node = os.environ['SLURM_NODEID']\n"
        "ignored = signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN\n"
        "path = os.path.join(os.environ['FAKE_SLURM_DIR'], f'accelerate-{node}.json')\n"
        "open(path, 'w').write(json.dumps({'argv': sys.argv[1:], 'usr1_ignored': ignored}))\n"
    )
    (tmp_path / "recorder.py").write_text(recorder)
    env = _job(tmp_path, accelerate=f'exec {shlex.quote(sys.executable)} {tmp_path / "recorder.py"} "$@"\n')
    overrides = [o.format(out=tmp_path) for o in TRICKY]
    proc = _sbatch(env, "configs/demo.yaml", *overrides)
    assert proc.returncode == 0, proc.stderr

    srun = json.loads((tmp_path / "slurm" / "srun.json").read_text())
    assert "--cpus-per-task=3" in srun["options"] and "--kill-on-bad-exit=1" in srun["options"]
    assert srun["env"]["MAIN_PORT"] == str(20000 + 4242) and srun["env"]["MAIN_IP"] == "127.0.0.1"
    assert srun["env"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == "300"
    assert "SIGUSR1" in srun["env"]["PET_SIGNALS_TO_HANDLE"].split(",")
    for node in (0, 1):
        seen = json.loads((tmp_path / "slurm" / f"accelerate-{node}.json").read_text())
        assert seen["usr1_ignored"]
        argv = seen["argv"]
        assert argv[0] == "launch"
        options = {name: value for name, value in itertools.pairwise(argv) if name.startswith("--")}
        assert options["--num_machines"] == "2" and options["--num_processes"] == "2"
        assert options["--machine_rank"] == str(node) and options["--main_process_port"] == "24242"
        assert options["--mixed_precision"] == "bf16"
        assert argv[argv.index("-m") :] == ["-m", "ddp_rank.cli", "train", "--config", "configs/demo.yaml",
                                             *overrides]  # fmt: skip


@pytest.mark.slow
def test_a_job_sets_its_port_and_precision_from_the_environment(tmp_path: Path) -> None:
    # ALLOW_SHORT_SHUTDOWN: no launcher check (a torch import of its own; the check's own tests are below).
    env = {**_job(tmp_path, accelerate="exit 0\n"), "MAIN_PORT": "31337", "MIXED_PRECISION": "no",
           "ALLOW_SHORT_SHUTDOWN": "1"}  # fmt: skip
    assert _sbatch(env, "configs/demo.yaml").returncode == 0
    srun = json.loads((tmp_path / "slurm" / "srun.json").read_text())
    assert srun["env"]["MAIN_PORT"] == "31337" and srun["env"]["MIXED_PRECISION"] == "no"


@pytest.mark.slow
def test_a_job_without_cpus_per_task_or_with_an_old_launcher_starts_nothing(tmp_path: Path) -> None:
    # ALLOW_SHORT_SHUTDOWN: the launcher check would pass here (the real torch), and cost a torch import.
    env = {**_job(tmp_path, accelerate="exit 0\n"), "ALLOW_SHORT_SHUTDOWN": "1"}
    proc = _sbatch({k: v for k, v in env.items() if k != "SLURM_CPUS_PER_TASK"}, "configs/demo.yaml")
    assert proc.returncode != 0 and "--cpus-per-task" in proc.stderr
    assert not (tmp_path / "slurm" / "srun.json").exists()

    old = tmp_path / "old"
    old.mkdir()
    env = _job(old, accelerate="exit 0\n", python="echo 'launcher check: too old' >&2; exit 1\n")
    proc = _sbatch(env, "configs/demo.yaml")
    assert proc.returncode != 0 and "too old" in proc.stderr
    assert not (old / "slurm" / "srun.json").exists()
    # ... unless the user accepts the 30 s.
    assert _sbatch({**env, "ALLOW_SHORT_SHUTDOWN": "1"}, "configs/demo.yaml").returncode == 0


def test_the_launcher_check_refuses_a_torch_without_a_shutdown_timeout() -> None:
    @dataclasses.dataclass
    class OldLaunchConfig:
        min_nodes: int
        max_nodes: int

    @dataclasses.dataclass
    class NewLaunchConfig(OldLaunchConfig):
        shutdown_timeout: int | None = None

    problem = shutdown_timeout_problem(OldLaunchConfig, "2.9.0")
    assert problem is not None and "torch 2.9.0" in problem and "ALLOW_SHORT_SHUTDOWN=1" in problem
    assert shutdown_timeout_problem(NewLaunchConfig, "2.99.0") is None
    assert shutdown_timeout_problem() is None  # the torch this suite runs on has the setting


@pytest.mark.slow
@pytest.mark.distributed
def test_a_sigusr1_to_the_job_stops_both_nodes_with_a_checkpoint_and_a_requeue(tmp_path: Path) -> None:
    shards = build_tiny_shards(tmp_path / "data")
    out = tmp_path / "run's dir"
    tricky = [o.format(out=tmp_path) for o in TRICKY]
    env = {**_job(tmp_path), "MAIN_PORT": str(free_port()), "MIXED_PRECISION": "no"}
    if shutdown_timeout_problem() is not None:
        # A torch older than the declared one (the GPU machine's image): its launcher's 30 s before the kill is
        # ample for this tiny run's checkpoint, and the script refuses to start without the user's consent.
        env["ALLOW_SHORT_SHUTDOWN"] = "1"
    args = ["configs/demo.yaml", f"data.shards={shards}", *tricky, *TINY_OVERRIDES, "train.steps=100000",
            "train.checkpoint_every=0", "model.weights=none"]  # fmt: skip
    job = subprocess.Popen(["bash", str(SCRIPT), *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.poll() is None:
        if (
            metrics.exists()
            and sum('"kind": "train"' in line for line in metrics.read_text().splitlines()) >= 2
        ):
            break
        time.sleep(0.5)
    assert job.poll() is None, job.communicate()[1][-3000:]
    srun_pid = int(subprocess.run(["pgrep", "-f", "fake_srun.py", "-P", str(job.pid)], capture_output=True,
                                  text=True).stdout.split()[0])  # fmt: skip
    os.kill(srun_pid, signal.SIGUSR1)
    _, err = job.communicate(timeout=240)
    # The launchers report the ranks' status 75 as a failure; the requeue carries on.
    assert job.returncode != 0

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    stops = [r for r in records if r["kind"] == "stop"]
    assert len(stops) == 1, err[-3000:]
    stopped = stops[0]["step"]
    assert (out / "checkpoints" / f"step-{stopped:08d}" / "model.safetensors").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "stopped"
    assert (tmp_path / "slurm" / "calls").read_text().splitlines() == ["requeue 4242"]
