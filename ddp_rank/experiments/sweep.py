"""Running a sweep: one ``ddp-rank train`` per grid point, one after another, each in its own folder under the
sweep's output (``<train.output_dir>/<key=value,...>/``), then the comparison of them all.

Each point is launched the same way (``Launcher``: one process, ``accelerate launch`` on N processes, or a
command of the user's own), always with ``train.resume=auto``: a point whose ``run.json`` says ``finished`` is
skipped, one that crashed, died or was stopped continues from its last checkpoint, so running the same sweep
again after an interruption finishes it. A point whose trainer still runs on this host (another sweep, a
scheduler's job) is skipped too: a second trainer in its folder would write over the first one's checkpoints.
With ``in_process_runner`` (``sweep --in-process``) one-process points train in the sweep's own process instead,
one after another, paying the imports once.
A point that fails does not stop the others; a point stopped on a signal (exit 75) stops the sweep with that
status, for the scheduler to requeue it.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddp_rank.experiments.grid import SweepPoint
from ddp_rank.train.preemption import EXIT_REQUEUE
from ddp_rank.train.run_state import is_alive, read_run_state

__all__ = ["Launcher", "SweepOutcome", "in_process_runner", "point_command", "run_sweep"]

REPO = Path(__file__).resolve().parents[2]
RUNNING_ELSEWHERE = "running elsewhere"


@dataclass(frozen=True)
class Launcher:
    """How each point's training starts: one process, ``processes`` > 1 under ``accelerate launch``, or
    ``command``, a launcher of the user's own (``torchrun --nproc-per-node 8``, ``accelerate launch --config_file
    my.yaml``) followed by ``-m ddp_rank.cli``.

    ``cpu`` says what the machine that runs the commands has: True, no GPU (gloo processes with the repository's
    CPU launcher file); False, GPUs (one process each); both on a free port of this machine. None: not known
    here, because the commands are printed for another machine (``sweep --print`` on a login node for a SLURM
    array): ``--multi_gpu`` with no port, which gives one process per GPU where there are GPUs and gloo
    processes where there are none (``ddp_rank.runtime.make_accelerator``), on accelerate's port
    of that machine (its default config's, else 29500; accelerate 1.15 takes a free one when that is busy),
    with its default config's mixed precision."""

    processes: int = 1
    command: str = ""
    cpu: bool | None = None

    def prefix(self) -> list[str]:
        if self.command:
            return [*shlex.split(self.command), "-m", "ddp_rank.cli"]
        if self.processes <= 1:
            return [sys.executable, "-m", "ddp_rank.cli"]
        launch = [sys.executable, "-m", "accelerate.commands.launch"]
        processes = ["--num_processes", str(self.processes)]
        if self.cpu is None:
            return [*launch, "--multi_gpu", *processes, "-m", "ddp_rank.cli"]
        if self.cpu:
            launcher_file = REPO / "launch" / "accelerate_cpu_2proc.yaml"
            if not launcher_file.is_file():
                raise FileNotFoundError(
                    f"{launcher_file} is missing (a source checkout has it); pass --launch 'accelerate launch ...'"
                )
            where = ["--config_file", str(launcher_file)]
        else:
            where = ["--multi_gpu"]
        port = ["--main_process_port", str(_free_port())]
        return [*launch, *where, *processes, *port, "-m", "ddp_rank.cli"]


@dataclass
class SweepOutcome:
    """What the sweep did with each point (its folder -> ``skipped`` / ``running elsewhere`` / ``finished`` /
    ``failed (exit n)``)."""

    done: dict[Path, str] = field(default_factory=dict)
    stopped: bool = False

    @property
    def failed(self) -> list[Path]:
        return [path for path, what in self.done.items() if what.startswith("failed")]

    @property
    def running_elsewhere(self) -> list[Path]:
        """The points left alone because another process still trains them."""
        return [path for path, what in self.done.items() if what == RUNNING_ELSEWHERE]


def point_dir(output_dir: str | os.PathLike[str], point: SweepPoint) -> Path:
    return Path(output_dir) / point.name


def point_command(
    launcher: Launcher,
    config_path: str | None,
    fixed: list[str],
    point: SweepPoint,
    output_dir: str | os.PathLike[str],
) -> list[str]:
    """The command that trains ``point`` (resuming it where it stopped); a value ``--equal images`` derived
    replaces the fixed one it was derived from."""
    config = ["--config", str(config_path)] if config_path else []
    derived = {override.split("=", 1)[0] for override in point.derived}
    fixed = [override for override in fixed if override.split("=", 1)[0] not in derived]
    return [
        *launcher.prefix(),
        "train",
        *config,
        *fixed,
        *point.overrides,
        f"train.output_dir={point_dir(output_dir, point)}",
        "train.resume=auto",
    ]


def run_sweep(
    commands: list[tuple[SweepPoint, Path, list[str]]],
    run: Callable[[list[str]], int] | None = None,
    say: Callable[[str], None] = print,
) -> SweepOutcome:
    """Run each ``(point, folder, command)`` that has not finished, in order; see the module docstring."""
    run = run or _run_command
    outcome = SweepOutcome()
    for i, (point, folder, command) in enumerate(commands, start=1):
        state = read_run_state(folder)
        if state is not None and state["status"] == "finished":
            say(f"[{i}/{len(commands)}] {point.name}: finished already, skipped")
            outcome.done[folder] = "skipped"
            continue
        if state is not None and state["status"] == "running" and is_alive(state):
            say(
                f"[{i}/{len(commands)}] {point.name}: warning: process {state.get('pid')} still trains it, "
                "skipped (run the sweep again once it has ended)"
            )
            outcome.done[folder] = RUNNING_ELSEWHERE
            continue
        again = f" (continuing a {state['status']} run)" if state is not None else ""
        say(f"[{i}/{len(commands)}] {point.name}{again}\n$ {shlex.join(command)}")
        code = run(command)
        if code == EXIT_REQUEUE:
            outcome.done[folder] = "stopped"
            outcome.stopped = True
            say(f"{point.name} was stopped on a signal: the sweep stops too; run it again to continue")
            break
        outcome.done[folder] = "finished" if code == 0 else f"failed (exit {code})"
        if code != 0:
            say(f"{point.name} failed with exit status {code}; going on with the next point")
    return outcome


def _run_command(command: list[str]) -> int:
    return subprocess.run(command).returncode


def in_process_runner(launcher: Launcher) -> Callable[[list[str]], int]:
    """A ``run`` for :func:`run_sweep` that trains each point's command in this process, one after another,
    each as it would train alone (``ddp_rank.experiments.in_process``): the imports and set-up are paid once.
    Only for the one-process launcher; made before the first point (it records the state each starts from)."""
    from ddp_rank.experiments.in_process import RunsInProcess

    if launcher.processes > 1 or launcher.command:
        raise ValueError(
            "--in-process trains one-process points in the sweep's own process: drop --processes / --launch, "
            "or --in-process to launch each point"
        )
    prefix = [*launcher.prefix(), "train"]
    runs = RunsInProcess()

    def run(command: list[str]) -> int:
        if command[: len(prefix)] != prefix:
            raise ValueError(f"not a one-process training command: {shlex.join(command)}")
        rest = command[len(prefix) :]
        config = None
        if rest[:1] == ["--config"]:
            config, rest = rest[1], rest[2:]
        return runs.train(config, rest)

    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
