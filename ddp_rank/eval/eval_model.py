"""The network a command evaluates, exports or searches with, built from the config's ``model`` and ``data``.

``ddp-rank eval``, ``export`` and :class:`~ddp_rank.eval.search.Searcher` all build their model here: the
untrained network, a checkpoint's weights, or a baseline; for a head trained on feature shards, the shards'
manifest gives the vectors' length and, when images are to be embedded, the recorded backbone in front of the
head (``ddp_rank.eval.features.images``).
"""

from __future__ import annotations

import torch

from ddp_rank.config import FEATURES_BACKBONE, ConfigError, DataConfig, ModelConfig
from ddp_rank.data.features.records import feature_record
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.features.images import image_data, image_model
from ddp_rank.model import RawPixels, build_model, load_model_weights, resolve_checkpoint
from ddp_rank.model.feature_head import FeatureHeadNet, RawFeatures
from ddp_rank.runtime.shards import model_input_dim, open_shards

__all__ = ["RAW_PIXEL_SIZE", "build_eval_model", "feature_shards", "images_in_front"]

RAW_PIXEL_SIZE = 64
"""Raw-pixel baseline: images are resized to at most this side before flattening (64 x 64 x 3 = 12,288-d)."""


def feature_shards(model: ModelConfig, data: DataConfig) -> Manifest | None:
    """The manifest of ``data.shards`` when the network is a head on feature shards (its input length and the
    backbone that made the vectors are recorded there), None for an image backbone (no shards needed)."""
    if model.backbone != FEATURES_BACKBONE:
        return None
    return open_shards(data.shards, model.backbone)


def build_eval_model(
    model: ModelConfig,
    image_size: int,
    manifest: Manifest | None,
    checkpoint: str | None,
    baseline: str | None,
) -> tuple[torch.nn.Module, str]:
    """The model to evaluate and its default name: raw pixels, the untrained network, or a checkpoint's.
    ``image_size``: ``data.image_size``; ``manifest``: :func:`feature_shards` (None for an image backbone)."""
    dim = model_input_dim(model.backbone, manifest) if manifest is not None else None
    if baseline == "raw-pixels" and dim is not None:  # on feature shards: the frozen backbone's own vectors
        return RawFeatures(), "raw features"
    if baseline == "raw-pixels":
        return RawPixels(min(image_size, RAW_PIXEL_SIZE)), "raw pixels"
    net = build_model(model, image_size, dim)
    if baseline == "untrained" or checkpoint is None:
        return net, f"{model.backbone} before training"
    path = load_model_weights(net, resolve_checkpoint(checkpoint))
    return net, f"{model.backbone} trained ({path.name})"


def images_in_front(
    net: torch.nn.Module, data: DataConfig, manifest: Manifest | None
) -> tuple[torch.nn.Module, DataConfig]:
    """``net`` ready for images, with the ``data`` section its images are read with: a feature head gets the
    backbone its shards (``manifest``) record in front of it and their transform; any other net is returned
    as it is."""
    if not isinstance(net, FeatureHeadNet) or manifest is None:
        return net, data
    record = feature_record(manifest)
    if record is None:  # open_shards refuses this for model.backbone=features; a guard for other callers
        raise ConfigError(f"{data.shards}/manifest.json has no build.features record")
    return image_model(record, data.shards, net), image_data(data, record)
