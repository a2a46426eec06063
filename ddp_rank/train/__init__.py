"""Training: the engine backends and the direct / chunked forward-backward of one step."""

from ddp_rank.train.backends import (
    AccelerateBackend,
    DDPBackend,
    DeepSpeedBackend,
    PlainBackend,
    StepBackend,
    backend_for_accelerator,
    frozen_batchnorm,
)
from ddp_rank.train.chunking.step import StepOutput, forward_backward
from ddp_rank.train.ghost_batchnorm import GhostBatchNorm, convert_to_ghost

__all__ = [
    "AccelerateBackend",
    "DDPBackend",
    "DeepSpeedBackend",
    "GhostBatchNorm",
    "PlainBackend",
    "StepBackend",
    "StepOutput",
    "backend_for_accelerator",
    "convert_to_ghost",
    "forward_backward",
    "frozen_batchnorm",
]
