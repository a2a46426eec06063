"""Images in front of a feature head: the backbone a feature shard set records, rebuilt and checked.

A head trained on feature shards (``model.backbone=features``) takes vectors; to embed an image (a ``search``
query, an ``export --images`` folder) the image must first go through the backbone that made the shards'
vectors, with the same weights, transform and precision. The manifest's ``build.features`` record says which;
the weights rebuilt here must have the digest it records, or the query would land in another space. Whitened
shards add their map (``whitening.safetensors``, checked against the sha256 the record holds) after the backbone.
"""

from __future__ import annotations

from typing import Any

import torch

from ddp_rank.config import ConfigError, DataConfig, ModelConfig
from ddp_rank.data.features.records import FeatureRecord
from ddp_rank.data.features.whitening import WhiteningError, load_whitening
from ddp_rank.model import build_model
from ddp_rank.model.feature_head import FeatureHeadNet, ImageFeatureNet, build_seeded, weights_digest
from ddp_rank.runtime import precision_dtype

__all__ = ["image_data", "image_model"]


def image_model(record: FeatureRecord, shards: str, head: FeatureHeadNet) -> ImageFeatureNet:
    """The backbone ``record`` (the ``build.features`` record of the feature shards at ``shards``) names,
    followed by ``head``; raises ``ConfigError`` when the backbone rebuilt from the record does not have the
    recorded weights."""
    # The record's strings are checked by the config's own validation (choices of a backbone, pooling, stride).
    recorded: dict[str, Any] = {
        "backbone": record.backbone,
        "weights": record.weights,
        "pooling": record.pooling,
        "output_stride": record.output_stride,
    }
    try:
        backbone_cfg = ModelConfig(**recorded)
    except ConfigError as exc:  # e.g. the synthetic vectors of ddp_rank.data.features.synthetic
        raise ConfigError(
            f"{shards}/manifest.json records the backbone {record.backbone!r}, which cannot embed an "
            f"image ({exc}); search with vectors of shards made by `ddp-rank shards features` instead"
        ) from exc
    image_size = int(record.transform["image_size"])
    backbone = build_seeded(lambda: build_model(backbone_cfg, image_size), record.init_seed)
    digest = weights_digest(backbone.backbone)
    if digest != record.weights_digest:
        raise ConfigError(
            f"{shards}/manifest.json: the vectors were made by {record.backbone} with weights "
            f"{record.weights} of digest {record.weights_digest[:12]}..., but those weights now have digest "
            f"{digest[:12]}...: restore the weights the shards were made with, or rebuild the feature shards"
        )
    whitening = None
    if record.whitening is not None:
        try:
            found = load_whitening(str(shards), record.whitening)
        except WhiteningError as exc:
            raise ConfigError(str(exc)) from exc
        whitening = (torch.from_numpy(found.mean), torch.from_numpy(found.projection))
    return ImageFeatureNet(backbone, head, precision_dtype(record.mixed_precision), whitening)


def image_data(data: DataConfig, record: FeatureRecord) -> DataConfig:
    """The ``data`` section with the transform ``record`` holds (crop, resize_size, image_size), so that images
    are cropped as the feature shards' images were."""
    return data.replaced(**{k: record.transform[k] for k in ("crop", "resize_size", "image_size")})
