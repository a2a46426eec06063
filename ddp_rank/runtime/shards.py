"""Opening a run's shards: the manifest of ``data.shards``, checked, or an error that says how to get one."""

from __future__ import annotations

from ddp_rank.config import FEATURES_BACKBONE, ConfigError, DataConfig
from ddp_rank.data.features.records import FeatureRecordError, feature_dim, feature_record
from ddp_rank.data.format.class_leaks import BUILT_FIX, leak_line, manifest_leak
from ddp_rank.data.format.manifest import MANIFEST_NAME, Manifest, is_url, join_location
from ddp_rank.runtime.errors import TrainError

__all__ = ["check_split", "model_input_dim", "open_shards", "open_training_shards"]


def open_shards(shards: str, backbone: str) -> Manifest:
    """The manifest of ``shards`` (``data.shards``), checked to hold what ``backbone`` (``model.backbone``)
    reads, or an error that says how to get one: ``model.backbone=features`` reads feature shards with a backbone
    record, any other backbone image shards. A run, ``ddp-rank plan``, ``eval`` and ``export`` open them so."""
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
    return manifest


def open_training_shards(data: DataConfig, backbone: str) -> Manifest:
    """The shards a run trains and evaluates on (the ``data`` section), checked before any process group exists:
    what :func:`open_shards` checks, then that ``data.train_split`` and ``data.test_split`` are splits of them,
    that no class of the training split is in another split unless the manifest records why (``shared_classes``:
    a run would report retrieval of classes it trained on), and that every training shard file is there."""
    manifest = open_shards(data.shards, backbone)
    for key, split in (("train_split", data.train_split), ("test_split", data.test_split)):
        if split and split not in manifest.splits:
            raise TrainError(
                f"data.{key}='{split}' is not a split of {data.shards} (it has {sorted(manifest.splits)}); "
                f"set data.{key}"
                + (" (or data.test_split= to train without evaluation)" if key == "test_split" else "")
            )
    problem = manifest_leak(manifest, data.train_split)
    if problem is not None:
        where = f"data.shards='{data.shards}': {join_location(data.shards, MANIFEST_NAME)}"
        raise TrainError(leak_line(where, problem, BUILT_FIX))
    local = not is_url(manifest.location)
    train_shards = manifest.split(data.train_split).shards
    missing = [s.path for s in train_shards if local and not manifest.shard_path(s).is_file()]
    if missing:
        raise TrainError(
            f"{len(missing)} shard file(s) of {data.shards} are missing, e.g. {missing[0]}: copy the whole "
            "shard directory or rebuild it (`ddp-rank shards verify` checks it)"
        )
    return manifest


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
