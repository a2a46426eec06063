"""Helpers shared by the benchmark scripts: the machine's description and dated markdown output."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import sys
from pathlib import Path

import torch

from ddp_rank.atomic_io import atomic_write_text

RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
"""The checkout these scripts are in: the working folder of the processes they start as ``python -m``."""


def machine_description() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{cpu}, {os.cpu_count()} logical cores, {gpu}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads; Python {platform.python_version()}"
    )


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, body: str) -> Path:
    """Write ``results/<name>-<YYYY-MM-DD>.md`` and return its path.

    A later run on the same day is appended as a section of its own (with its time and machine): an earlier
    table, and the notes written under it, are never overwritten.
    """
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    now = _dt.datetime.now()
    today = now.date().isoformat()
    path = RESULTS_DIR / f"{name}-{today}.md"
    if path.exists():
        with path.open("a") as results:
            results.write(f"\n## Run of {now:%H:%M}\n\nMachine: {machine_description()}\n\n{body}\n")
    else:
        path.write_text(f"# {title}\n\nDate: {today}  \nMachine: {machine_description()}\n\n{body}\n")
    return path


def write_json(path: str | Path, value: object) -> None:
    """Write ``value`` as JSON to ``path`` whole or not at all (a run stopped mid-write leaves the last file)."""
    atomic_write_text(path, json.dumps(value, indent=1))


def free_port() -> int:
    """A TCP port free on loopback now (for a launcher's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_cpu_cmd(repo: Path, *args: str, processes: int = 2) -> list[str]:
    """``accelerate launch`` of ``args`` on ``processes`` gloo CPU processes (the repository's launcher file)."""
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(repo / "launch" / "accelerate_cpu_2proc.yaml"),
        "--num_processes", str(processes), "--main_process_port", str(free_port()),
        *args,
    ]  # fmt: skip


def mixed_checkout(ddp_rank_root: str | Path, folder: str | Path) -> Path:
    """``folder`` made to hold another checkout's ``ddp_rank`` beside this checkout's ``benchmarks`` (two symbolic
    links): ``python -m benchmarks.<name>`` run from it times that ``ddp_rank`` with these scripts (``python -m``
    puts the folder it runs from first on ``sys.path``, so both packages come from there)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name, target in (("ddp_rank", Path(ddp_rank_root).resolve() / "ddp_rank"), ("benchmarks", REPO / "benchmarks")):
        if not target.is_dir():
            raise FileNotFoundError(f"{target} is not a folder: no {name} package there")
        link = folder / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)
    return folder


def cpu_job_env() -> dict[str, str]:
    """A launched CPU job's environment, whatever GPUs the machine has (no CUDA device for the ranks,
    DeepSpeed's CPU accelerator), one thread per rank."""
    return {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
    }
