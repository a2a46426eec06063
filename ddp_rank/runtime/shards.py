"""Opening a run's shards: the manifest of ``data.shards``, or an error that says how to get one."""

from __future__ import annotations

from ddp_rank.config import FEATURES_BACKBONE, Config, ConfigError
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.features.records import FeatureRecordError, feature_dim, feature_record
from ddp_rank.runtime.errors import TrainError

__all__ = ["check_model_input", "check_split", "model_input_dim", "open_shards"]


def open_shards(cfg: Config) -> Manifest:
    """The manifest of ``data.shards``, or an error that says how to get one."""
    if not cfg.data.shards:
        raise ConfigError(
            "data.shards is empty: set it to a shard directory built by `ddp-rank shards build`"
        )
    try:
        manifest = Manifest.load(cfg.data.shards)
    except FileNotFoundError as exc:
        raise TrainError(
            f"data.shards='{cfg.data.shards}': {exc}. Build the shards first (`ddp-rank shards build SOURCE "
            f"{cfg.data.shards}`) or point data.shards at an existing shard directory"
        ) from exc
    except ValueError as exc:
        raise TrainError(f"data.shards='{cfg.data.shards}': {exc}") from exc
    check_model_input(manifest, cfg)
    return manifest


def check_model_input(manifest: Manifest, cfg: Config) -> None:
    """``model.backbone=features`` reads feature shards with a backbone record, any other backbone image shards;
    anything else is refused with the fix."""
    try:
        record = feature_record(manifest)
    except FeatureRecordError as exc:
        raise ConfigError(
            f"data.shards='{cfg.data.shards}': {exc}; rebuild with `ddp-rank shards features`"
        ) from exc
    if cfg.model.backbone == FEATURES_BACKBONE and record is None:
        raise ConfigError(
            f"model.backbone={FEATURES_BACKBONE}: {cfg.data.shards}/manifest.json has no build.features record "
            "(the backbone, its weights' digest, the transform and the dimension of the vectors); make feature "
            "shards with `ddp-rank shards features IMAGE_SHARDS DST --config CONFIG` and set data.shards=DST"
        )
    if record is not None and cfg.model.backbone != FEATURES_BACKBONE:
        raise ConfigError(
            f"data.shards='{cfg.data.shards}' holds {record.dim}-d feature vectors (made by {record.backbone}), "
            f"not images: set model.backbone={FEATURES_BACKBONE} to train a head on them"
        )


def model_input_dim(cfg: Config, manifest: Manifest | None = None) -> int | None:
    """The vectors' length the network takes (``model.backbone=features``), None for an image backbone."""
    if cfg.model.backbone != FEATURES_BACKBONE:
        return None
    return feature_dim(manifest if manifest is not None else open_shards(cfg))


def check_split(manifest: Manifest, cfg: Config, split: str) -> None:
    """``split`` is a split of the run's shards, or an error naming the splits there are."""
    if split not in manifest.splits:
        raise ConfigError(f"split '{split}' is not in {cfg.data.shards} (it has {sorted(manifest.splits)})")
