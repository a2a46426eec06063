"""Opening a run's shards: the manifest of ``data.shards``, or an error that says how to get one."""

from __future__ import annotations

from ddp_rank.config import FEATURES_BACKBONE, ConfigError
from ddp_rank.data.features.records import FeatureRecordError, feature_dim, feature_record
from ddp_rank.data.format.class_leaks import BUILT_FIX, leak_line, manifest_leak
from ddp_rank.data.format.manifest import MANIFEST_NAME, Manifest, join_location
from ddp_rank.runtime.errors import TrainError

__all__ = ["check_held_out_classes", "check_model_input", "check_split", "model_input_dim", "open_shards"]


def open_shards(shards: str, backbone: str) -> Manifest:
    """The manifest of ``shards`` (``data.shards``), checked to hold what ``backbone`` (``model.backbone``)
    reads, or an error that says how to get one."""
    if not shards:
        raise ConfigError(
            "data.shards is empty: set it to a shard directory built by `ddp-rank shards build`"
        )
    try:
        manifest = Manifest.load(shards)
    except FileNotFoundError as exc:
        raise TrainError(
            f"data.shards='{shards}': {exc}; or point data.shards at an existing shard directory"
        ) from exc
    except ValueError as exc:
        raise TrainError(f"data.shards='{shards}': {exc}") from exc
    check_model_input(manifest, shards, backbone)
    return manifest


def check_model_input(manifest: Manifest, shards: str, backbone: str) -> None:
    """``model.backbone=features`` reads feature shards with a backbone record, any other backbone image shards;
    anything else is refused with the fix. ``shards``: where ``manifest`` came from, for the messages."""
    try:
        record = feature_record(manifest)
    except FeatureRecordError as exc:
        raise ConfigError(f"data.shards='{shards}': {exc}; rebuild with `ddp-rank shards features`") from exc
    if backbone == FEATURES_BACKBONE and record is None:
        raise ConfigError(
            f"model.backbone={FEATURES_BACKBONE}: {shards}/manifest.json has no build.features record "
            "(the backbone, its weights' digest, the transform and the dimension of the vectors); make feature "
            "shards with `ddp-rank shards features IMAGE_SHARDS DST --config CONFIG` and set data.shards=DST"
        )
    if record is not None and backbone != FEATURES_BACKBONE:
        raise ConfigError(
            f"data.shards='{shards}' holds {record.dim}-d feature vectors (made by {record.backbone}), "
            f"not images: set model.backbone={FEATURES_BACKBONE} to train a head on them"
        )


def model_input_dim(backbone: str, manifest: Manifest) -> int | None:
    """The vectors' length the network takes (``model.backbone=features``), None for an image backbone."""
    if backbone != FEATURES_BACKBONE:
        return None
    return feature_dim(manifest)


def check_split(manifest: Manifest, shards: str, split: str) -> None:
    """``split`` is a split of the run's shards (``shards``: where ``manifest`` came from), or an error naming the
    splits there are."""
    if split not in manifest.splits:
        raise ConfigError(f"split '{split}' is not in {shards} (it has {sorted(manifest.splits)})")


def check_held_out_classes(manifest: Manifest, shards: str, train_split: str) -> None:
    """No class of ``train_split`` (``data.train_split``) in another split of the run's shards, unless the
    manifest records why (``shared_classes``): a run would report retrieval of classes it trained on. Checked
    before anything is built; ``shards``: where ``manifest`` came from, for the message."""
    problem = manifest_leak(manifest, train_split)
    if problem is not None:
        where = f"data.shards='{shards}': {join_location(shards, MANIFEST_NAME)}"
        raise TrainError(leak_line(where, problem, BUILT_FIX))
