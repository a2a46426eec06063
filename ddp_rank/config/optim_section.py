"""The ``optim`` section: the optimizer and the learning-rate schedule."""

from __future__ import annotations

from typing import Annotated, Literal

from ddp_rank.config.checks import (
    Float,
    Int,
    ListOf,
    NonNegative,
    Positive,
    _field,
    _Section,
)


class OptimConfig(_Section):
    """Optimizer and learning-rate schedule (defaults: the FastAP paper, sec. 5.1)."""

    name: Literal["adam", "adamw", "sgd"] = _field(
        "adam",
        "Optimizer (FastAP: Adam; PNP: Adam with weight decay 4e-4).",
    )
    lr: Float = _field(1e-5, "Base learning rate of the backbone (papers: 1e-5).", minimum=0.0)
    head_lr_mult: Float = _field(
        10.0, "Learning-rate multiplier of the embedding head (FastAP: 10x).", minimum=0.0
    )
    weight_decay: Float = _field(0.0, "Weight decay (FastAP: 0, PNP: 4e-4).", minimum=0.0)
    betas: Annotated[list[NonNegative], ListOf] = _field([0.9, 0.999], "Adam betas, each in [0, 1).")
    momentum: Float = _field(0.9, "SGD momentum.", minimum=0.0)
    schedule: Literal["constant", "cosine", "linear", "step"] = _field(
        "constant",
        "Learning-rate schedule after warm-up: constant, cosine (to min_lr_ratio), linear (to min_lr_ratio), "
        "step (x step_gamma at each of step_milestones).",
    )
    warmup_steps: Int = _field(0, "Linear warm-up steps from 0 to the base rate.", minimum=0)
    min_lr_ratio: Float = _field(
        0.0, "Cosine / linear: final rate as a fraction of the base rate.", minimum=0.0, maximum=1.0
    )
    step_milestones: Annotated[list[Positive], ListOf] = _field(
        [], "Step schedule: steps at which the rate is multiplied."
    )
    step_gamma: Float = _field(0.1, "Step schedule: the multiplier.", minimum=0.0)
    grad_clip: Float = _field(
        0.0, "Clip the global gradient norm to this value; 0 = no clipping.", minimum=0.0
    )
