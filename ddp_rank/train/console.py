"""What the trainer reports while it runs (rank 0, through ``ddp_rank.logs``): lines that read well in a SLURM log.

On a terminal with ``train.progress`` the tqdm bar shows the steps; anywhere else (a batch job's log file, a
pipe) one line per ``train.log_every`` steps says where the run is::

    2026-11-22 15:40:01 step 120/330 (epoch 0.36) loss 0.4123 | 1520 img/s | data 0.012 s/step |
        lr 1.0e-05 / 1.0e-04 | mem 12.3 GiB | ETA 0:05:12

(on one line). Events (a resume, a checkpoint, a new best, an evaluation's table) are logged as they happen.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["StepLine", "format_duration", "peak_memory"]


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` (days spelled out past 24 hours)."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{days}d {text}" if days else text


def peak_memory(device: torch.device) -> str:
    """The peak memory since the last call: device memory on CUDA (then reset), the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        return f"{peak / 2**30:.1f} GiB"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return f"{rss_kib / 2**20:.1f} GiB RSS"


@dataclass(frozen=True)
class StepLine:
    """The numbers of one progress line."""

    step: int
    total: int
    epoch: float
    loss: float
    images_per_s: float
    data_time: float
    lrs: Sequence[float]
    memory: str
    eta_s: float

    def __str__(self) -> str:
        lrs = " / ".join(f"{lr:.1e}" for lr in self.lrs)
        return (
            f"step {self.step}/{self.total} (epoch {self.epoch:.2f}) loss {self.loss:.4f} | "
            f"{self.images_per_s:.0f} img/s | data {self.data_time:.3f} s/step | lr {lrs} | "
            f"mem {self.memory} | ETA {format_duration(self.eta_s)}"
        )
