"""The config translated once, for the evaluation: ``Config`` -> :class:`~ddp_rank.eval.runner.EvalSettings`.

The evaluation's settings (its ``eval`` and ``data`` sections, ``train.seed``) are the eval layer's own; the
trainer and ``ddp-rank eval`` / ``export`` call :func:`evaluation_settings` once at start-up and hand the result
down; a run checks them against its shards at start-up with :func:`check_evaluation`. :func:`load_run_config`
finds the config a checkpoint or an export was made with, so that a command reading a run needs nothing from a
layer above it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_rank.config import Config, ConfigError, DataConfig, ModelConfig, config_from_dict, load_config
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.protocols import metric_names
from ddp_rank.eval.runner import EvalSettings, vehicleid_splits
from ddp_rank.model import read_meta, resolve_checkpoint

__all__ = ["check_evaluation", "evaluation_settings", "index_settings", "load_run_config"]


def evaluation_settings(cfg: Config) -> EvalSettings:
    """The evaluation's settings: the ``eval`` and ``data`` sections as they are, and ``train.seed``."""
    return EvalSettings(cfg.eval, cfg.data, cfg.train.seed)


def check_evaluation(settings: EvalSettings, best_metric: str, manifest: Manifest) -> None:
    """What the evaluation needs, checked at start-up rather than at the first evaluation: the test lists of
    VehicleID recipe shards, and ``best_metric`` (``train.best_metric``) among the metrics the protocol will
    report."""
    if not settings.data.test_split:
        return
    e = settings.eval
    sizes: list[str] = list(e.vehicleid_sizes)
    if e.protocol == "vehicleid":
        sizes = list(vehicleid_splits(settings, manifest)) or sizes
    names = metric_names(
        e.protocol,
        list(e.ks) or None,
        map_at_r=e.map_at_r,
        vehicleid_sizes=sizes,
        metrics=list(e.metrics),
        deployment=settings.deployment,
    )
    if best_metric not in names:
        valid = [n for n in names if not n.rsplit("/", 1)[-1].startswith("num_")]
        raise ConfigError(
            f"train.best_metric='{best_metric}' is not among the metrics eval.protocol="
            f"{e.protocol} reports with these settings; valid: {', '.join(valid)}"
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
