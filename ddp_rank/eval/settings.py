"""The config translated once, for the evaluation: ``Config`` -> :class:`~ddp_rank.eval.runner.EvalSettings`.

The evaluation's settings are the eval layer's own; the trainer and ``ddp-rank eval`` / ``export`` / ``search`` call
:func:`evaluation_settings` once at start-up and hand the result down. :func:`load_run_config` finds the config a
checkpoint or an export was made with, so that a command reading a run needs nothing from a layer above it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_rank.config import Config, ConfigError, DataConfig, ModelConfig, config_from_dict, load_config
from ddp_rank.eval.deployment import DeploymentSettings
from ddp_rank.eval.runner import EvalSettings
from ddp_rank.model import read_meta, resolve_checkpoint

__all__ = ["deployment_settings", "evaluation_settings", "index_settings", "load_run_config"]


def deployment_settings(cfg: Config) -> DeploymentSettings:
    """The verification / identification settings of ``cfg.eval`` (the split seeded with ``train.seed``)."""
    return DeploymentSettings(
        fprs=tuple(cfg.eval.fprs),
        fpirs=tuple(cfg.eval.fpirs),
        enrolled_fraction=cfg.eval.enrolled_fraction,
        gallery_per_identity=cfg.eval.gallery_per_identity,
        max_positive_pairs=cfg.eval.max_positive_pairs,
        block_bytes=cfg.eval.block_mb << 20,
        seed=cfg.train.seed,
    )


def evaluation_settings(cfg: Config) -> EvalSettings:
    """The evaluation's settings: the ``eval`` section, ``train.seed`` and the ``data`` section."""
    e = cfg.eval
    return EvalSettings(
        data=cfg.data,
        protocol=e.protocol,
        ks=tuple(e.ks),
        batch_size=e.batch_size,
        search=e.search,
        map_at_r=e.map_at_r,
        vehicleid_sizes=tuple(e.vehicleid_sizes),
        vehicleid_repeats=e.vehicleid_repeats,
        metrics=tuple(e.metrics),
        deployment=deployment_settings(cfg),
        seed=cfg.train.seed,
        grid_queries=e.grid_queries,
        grid_k=e.grid_k,
        grid_seed=e.grid_seed,
    )


def load_run_config(config: str | None, checkpoint: str | None, overrides: list[str]) -> Config:
    """The config to evaluate with: ``config`` if given, else the run's own ``config.yaml`` found from the
    checkpoint (a run directory, its ``checkpoints/`` folder or a ``step-*`` directory), else the config stored
    in the checkpoint's ``meta.json``. Overrides apply on top."""
    if config is not None or checkpoint is None:
        return load_config(config, overrides)
    p = Path(checkpoint)
    for candidate in (p / "config.yaml", p.parent / "config.yaml", p.parent.parent / "config.yaml"):
        if candidate.is_file():
            return load_config(candidate, overrides)
    try:
        meta = read_meta(resolve_checkpoint(checkpoint))
    except Exception as exc:
        raise ConfigError(
            f"--checkpoint {checkpoint}: no config.yaml in the run directory and no readable checkpoint ({exc}); "
            "pass --config with the YAML the run was trained with"
        ) from exc
    if "config" not in meta:
        raise ConfigError(
            f"--checkpoint {checkpoint}: no config.yaml in the run directory and none in its meta.json; pass --config"
        )
    return config_from_dict(meta["config"], overrides, f"{checkpoint} (meta.json)")


def index_settings(
    export: dict[str, Any], origin: str, config: str | None, checkpoint: str | None
) -> tuple[ModelConfig, DataConfig]:
    """The ``model`` and ``data`` sections of a search index: those of ``config`` if given, else of the config
    the export recorded (``export``, from ``origin``), else of the run ``checkpoint`` belongs to."""
    if config is not None:
        cfg = load_config(config)
    elif "config" in export:
        cfg = config_from_dict(export["config"], origin=origin)
    else:
        cfg = load_run_config(None, checkpoint, [])
    return cfg.model, cfg.data
