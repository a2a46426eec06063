"""Opening a run's shards: the manifest of ``data.shards``, or an error that says how to get one."""

from __future__ import annotations

from ddp_rank.config import Config, ConfigError
from ddp_rank.data.manifest import Manifest
from ddp_rank.runtime.errors import TrainError

__all__ = ["check_split", "open_shards"]


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
    return manifest


def check_split(manifest: Manifest, cfg: Config, split: str) -> None:
    """``split`` is a split of the run's shards, or an error naming the splits there are."""
    if split not in manifest.splits:
        raise ConfigError(f"split '{split}' is not in {cfg.data.shards} (it has {sorted(manifest.splits)})")
