"""The accelerator of a run and the one precision every part of it uses.

``start_accelerator`` picks gloo on CPU, NCCL on GPUs and DeepSpeed when the launcher asks; ``autocast_dtype``
reads the precision back from that accelerator. Training, its periodic evaluation, ``ddp-rank eval``, ``export``
and ``search`` all take their autocast dtype from here, so one checkpoint gives one set of numbers whichever
command evaluates it (reading ``train.mixed_precision`` from the config instead would miss ``auto`` under a bf16
launcher).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ddp_rank.config import Config, ConfigError, DistributedConfig
from ddp_rank.runtime.errors import TrainError

log = logging.getLogger(__name__)

__all__ = [
    "autocast_dtype",
    "make_accelerator",
    "precision_dtype",
    "resolve_mixed_precision",
    "start_accelerator",
]

_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision_dtype(mixed_precision: str) -> torch.dtype | None:
    """The autocast dtype of a mixed-precision name (``bf16``, ``fp16``; None for ``no`` and anything else)."""
    return _AUTOCAST.get(str(mixed_precision))


def autocast_dtype(accelerator: Any) -> torch.dtype | None:
    """The autocast dtype of the accelerator's mixed precision (None for full precision)."""
    return precision_dtype(str(accelerator.mixed_precision))


def resolve_mixed_precision(configured: str, launcher: str | None = None) -> str:
    """The one precision of a run, from ``train.mixed_precision`` and the launcher's (``accelerate launch``
    exports it as ACCELERATE_MIXED_PRECISION; "no" there is also what it exports when nothing was asked)."""
    launcher = (
        launcher if launcher is not None else os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    ).lower()
    if configured == "auto":
        return launcher if launcher in ("fp16", "bf16") else "no"
    if launcher in ("fp16", "bf16") and launcher != configured:
        raise ConfigError(
            f"the launcher asks for mixed precision {launcher} but train.mixed_precision={configured}: set "
            f"train.mixed_precision=auto (or {launcher}) to follow the launcher, or change the launcher's "
            "mixed_precision"
        )
    return configured


def start_accelerator(
    distributed: DistributedConfig, mixed_precision: str, tracker_arguments: dict[str, Any] | None = None
) -> Any:
    """An ``Accelerator`` for this machine: gloo on CPU (also under ``accelerate launch --multi_gpu`` with no
    GPU), NCCL on GPUs, DeepSpeed when the launcher config asks for it. ``distributed``: the config's section
    (``cpu``, ``find_unused_parameters``); ``mixed_precision``: ``train.mixed_precision`` as configured (resolved
    against the launcher's here); ``tracker_arguments``: the trainer's experiment trackers (``log_with`` and the
    logging directory, ``ddp_rank.train.trackers``)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    cpu = distributed.cpu or not torch.cuda.is_available() or _too_few_gpus()
    if deepspeed and cpu:
        # Checked with accelerate 1.15: Accelerator(cpu=True) silently drops the DeepSpeed plugin (plain DDP),
        # and Accelerator(cpu=False) without a GPU reports every process as rank 0 of 1. Neither is what was asked.
        raise TrainError(
            "a DeepSpeed launcher config needs one GPU per process (accelerate cannot run DeepSpeed on CPU "
            "processes); on CPU use launch/accelerate_cpu_2proc.yaml"
        )
    return Accelerator(
        cpu=cpu,
        mixed_precision=resolve_mixed_precision(mixed_precision),
        kwargs_handlers=[
            DistributedDataParallelKwargs(find_unused_parameters=distributed.find_unused_parameters)
        ],
        **(tracker_arguments or {}),
    )


def make_accelerator(cfg: Config, tracker_arguments: dict[str, Any] | None = None) -> Any:
    """The accelerator of a command started from ``cfg`` (:func:`start_accelerator` on its ``distributed``
    section and ``train.mixed_precision``). ``tracker_arguments``: see :func:`start_accelerator`."""
    return start_accelerator(cfg.distributed, cfg.train.mixed_precision, tracker_arguments)


def _too_few_gpus() -> bool:
    """More processes on this node than visible GPUs (a 2-process CPU launcher on a 1-GPU machine): NCCL refuses
    two ranks on one device, so these processes run on the CPU with gloo, and rank 0 says so."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if local <= gpus:
        return False
    if int(os.environ.get("RANK", "0")) == 0:
        log.warning(
            f"{local} processes on this node but {gpus} GPU(s): training on the CPU (gloo). "
            "Launch one process per GPU (--num_processes) to use them."
        )
    return True
