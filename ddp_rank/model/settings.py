"""The model layer's settings for one run: the network to build and how BatchNorm trains in it.

The model layer reads no experiment config: ``ddp_rank.runtime.settings.model_settings`` copies the config's
``model`` section (and ``data.image_size``, the size the network is built for) into one :class:`ModelSettings` at
start-up. The field names are the config keys', so :func:`~ddp_rank.model.net.build_model` takes either.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelSettings"]


@dataclass(frozen=True)
class ModelSettings:
    """The network of a run, from the config keys ``model.*`` of the same names; ``image_size`` is
    ``data.image_size`` (EfficientNet-Lite and vision transformers are built for it), ``init_seed`` is
    ``train.seed`` (the seed of the fresh weights)."""

    backbone: str = "resnet50"
    weights: str = "none"
    init_from: str = ""
    pooling: str = "default"
    output_stride: int = 32
    embedding_dim: int = 512
    normalize: bool = True
    head_hidden: int = 0
    freeze_bn: str = "auto"
    sync_bn: bool = False
    bn_group_size: int = 0
    image_size: int = 224
    init_seed: int = 0
