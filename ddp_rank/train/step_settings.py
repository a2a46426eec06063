"""What the optimisation step reads: the batch, the chunk, BatchNorm, capture, clipping and reduction.

One object for the step's parts (the batch layout and its BatchNorm mode, the automatic chunk size, the captured
chunk, the trainer's clipping and the global-batch loss's reduction), made once at start-up by
``ddp_rank.train.settings``. It holds the four config sections those parts read, as they are: the step spans
them (the images of a batch, the network's width and BatchNorm, the chunk and its memory budget, the optimizer
state the budget counts), and none of its parts reads the whole config.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_rank.config import DataConfig, DistributedConfig, ModelConfig, OptimConfig

__all__ = ["StepSettings"]


@dataclass(frozen=True)
class StepSettings:
    """The step of a run: ``data`` (``global_batch_size``, ``image_size``, ``sampler``, ``images_per_class``:
    the images a step embeds and the most positives a query has, which size the loss's work space), ``model``
    (``freeze_bn``, ``sync_bn``, ``bn_group_size``, ``embedding_dim``), ``distributed`` (``chunk_size`` as
    ``fixed_chunk``: None for ``auto``, 0 for never chunk; ``capture_chunk``, ``memory_fraction``,
    ``memory_budget_mb``, ``grad_reduction``) and ``optim`` (``name``, ``momentum``: the optimizer state the
    memory budget counts; ``grad_clip``)."""

    data: DataConfig
    model: ModelConfig
    distributed: DistributedConfig
    optim: OptimConfig
