"""The embedding network and its weights: backbones, pooling, the head, weight files, ``init_from``, and reading a
run's checkpoints. What training, evaluation and deployment share; it knows no ranks, losses or loops."""

from ddp_rank.checkpoints.read import CheckpointError, load_model_weights, read_meta, resolve_checkpoint
from ddp_rank.model.init_weights import InitReport, init_from, read_weights
from ddp_rank.model.net import (
    EmbeddingNet,
    ModelError,
    RawPixels,
    build_model,
    freeze_batchnorm,
    has_batchnorm,
    is_convolutional,
)

__all__ = [
    "CheckpointError",
    "EmbeddingNet",
    "InitReport",
    "ModelError",
    "RawPixels",
    "build_model",
    "freeze_batchnorm",
    "has_batchnorm",
    "init_from",
    "is_convolutional",
    "load_model_weights",
    "read_meta",
    "read_weights",
    "resolve_checkpoint",
]
