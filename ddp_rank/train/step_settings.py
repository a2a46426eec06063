"""The settings of the optimisation step: the batch, the chunk, BatchNorm, capture, clipping and reduction.

One object for what the step's parts read (the batch layout and its BatchNorm mode, the automatic chunk size, the
captured chunk, the trainer's clipping and the global-batch loss's reduction), made once at start-up from the
config by ``ddp_rank.train.settings``; none of those parts reads the config itself.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepSettings"]


@dataclass(frozen=True)
class StepSettings:
    """The step of a run. From the config keys: ``global_batch_size``, ``image_size``, ``sampler``,
    ``images_per_class`` (``data.*``: the images a step embeds and the most positives a query has, which size
    the loss's work space); ``fixed_chunk`` (``distributed.chunk_size``: None for ``auto``, 0 for never chunk),
    ``capture_chunk``, ``memory_fraction``, ``memory_budget_mb``, ``grad_reduction`` (``distributed.*``);
    ``freeze_bn``, ``sync_bn``, ``bn_group_size``, ``embedding_dim`` (``model.*``); ``optimizer``,
    ``momentum``, ``grad_clip`` (``optim.name``, ``optim.momentum``: the optimizer state the memory budget
    counts; ``optim.grad_clip``)."""

    global_batch_size: int = 256
    image_size: int = 224
    sampler: str = "auto"
    images_per_class: int = 4
    fixed_chunk: int | None = None
    capture_chunk: str = "none"
    memory_fraction: float = 0.8
    memory_budget_mb: int = 0
    grad_reduction: str = "mean"
    freeze_bn: str = "auto"
    sync_bn: bool = False
    bn_group_size: int = 0
    embedding_dim: int = 512
    optimizer: str = "adam"
    momentum: float = 0.9
    grad_clip: float = 0.0
