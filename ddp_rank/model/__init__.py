"""The embedding network and its weights: backbones, pooling, the head, weight files, ``init_from``, and reading a
run's checkpoints. What training, evaluation and deployment share; it knows no ranks, losses or loops.

The public names load on first use (as in ``ddp_rank.data``): ``feature_head`` builds on ``model.embedding``
while ``model.net`` builds the head, so an ``__init__`` that imported ``net`` would make importing the head
import the head again, half-defined.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddp_rank.lazy_exports import lazy_exports

if TYPE_CHECKING:  # the same names for type checkers; at run time ``__getattr__`` below loads them
    from ddp_rank.model.checkpoint_read import (
        CheckpointError,
        load_model_weights,
        read_meta,
        resolve_checkpoint,
    )
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

_EXPORTS = {
    "CheckpointError": "ddp_rank.model.checkpoint_read",
    "load_model_weights": "ddp_rank.model.checkpoint_read",
    "read_meta": "ddp_rank.model.checkpoint_read",
    "resolve_checkpoint": "ddp_rank.model.checkpoint_read",
    "InitReport": "ddp_rank.model.init_weights",
    "init_from": "ddp_rank.model.init_weights",
    "read_weights": "ddp_rank.model.init_weights",
    "EmbeddingNet": "ddp_rank.model.net",
    "ModelError": "ddp_rank.model.net",
    "RawPixels": "ddp_rank.model.net",
    "build_model": "ddp_rank.model.net",
    "freeze_batchnorm": "ddp_rank.model.net",
    "has_batchnorm": "ddp_rank.model.net",
    "is_convolutional": "ddp_rank.model.net",
}

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
