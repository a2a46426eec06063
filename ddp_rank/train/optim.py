"""Optimizer and learning-rate schedule from the config (defaults: the FastAP paper's Adam, lr 1e-5, 10x head).

The schedule is a ``LambdaLR`` over optimizer steps: linear warm-up to the base rate, then constant, cosine or
linear decay to ``min_lr_ratio``, or step decay. It is a pure function of the step, so a resumed run (whose
scheduler state holds the step count) continues the same curve.

Why the scheduler is not passed through ``accelerator.prepare``: accelerate's scheduler wrapper steps the
schedule once per process per call (it assumes the data loader was split by rank and so has fewer steps); our
stream yields one GLOBAL batch per step, so the schedule must advance exactly once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddp_rank.config import OptimConfig

__all__ = ["apply_optim_config", "build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(param_groups: list[dict[str, Any]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """Adam / AdamW / SGD of the config's ``optim`` section over the model's parameter groups (each group keeps
    its own ``lr``)."""
    groups = [{k: v for k, v in g.items() if k != "name"} | {"name": g.get("name", "")} for g in param_groups]
    if cfg.name == "adam":
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)  # type: ignore[arg-type]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)  # type: ignore[arg-type]
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(
        f"optim.name={cfg.name!r}: valid are adam, adamw, sgd"
    )  # pragma: no cover - config checks


def lr_factor(cfg: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base rates at optimizer step ``s`` (0-based): warm-up, then the schedule."""
    warmup = cfg.warmup_steps
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / decay_steps)
        if cfg.schedule == "constant":
            return 1.0
        if cfg.schedule == "cosine":
            return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))
        if cfg.schedule == "linear":
            return 1.0 - (1.0 - cfg.min_lr_ratio) * t
        # step
        return cfg.step_gamma ** sum(step >= m for m in cfg.step_milestones)

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    """The ``LambdaLR`` for :func:`lr_factor`; step it once per optimizer step."""
    return LambdaLR(optimizer, lr_factor(cfg, total_steps))


def apply_optim_config(
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR,
    fresh_groups: list[dict[str, Any]],
    cfg: OptimConfig,
    total_steps: int,
    step: int,
) -> None:
    """Make ``cfg``'s hyper-parameters apply at ``step`` to a restored optimizer and schedule, which carry their
    checkpoint's (base rates, weight decay, betas, momentum): a forced resume with new values. ``fresh_groups``
    are the parameter groups as this config builds them (their ``lr``, ``weight_decay``)."""
    factor = lr_factor(cfg, total_steps)(step)
    for group, new in zip(optimizer.param_groups, fresh_groups):
        group["initial_lr"] = new["lr"]
        group["lr"] = new["lr"] * factor
        group["weight_decay"] = new["weight_decay"]
        if "betas" in group:
            group["betas"] = tuple(cfg.betas)
        if "momentum" in group:
            group["momentum"] = cfg.momentum
    scheduler.base_lrs = [g["lr"] for g in fresh_groups]
    scheduler.last_epoch = step
    scheduler._last_lr = [g["lr"] for g in optimizer.param_groups]
