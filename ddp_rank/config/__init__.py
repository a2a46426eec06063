"""Typed experiment configuration: pydantic models loaded from YAML with ``key=value`` overrides.

The files, one job each:

- :mod:`~ddp_rank.config.schema`: :class:`Config` (one section per layer) with the checks across sections, and
  :func:`config_json_schema`; the sections themselves, each field with its doc, type, choices and bounds and
  each section with its own checks, in one file per section (``data_section``, ``model_section``,
  ``loss_section``, ``optim_section``, ``train_section``, ``eval_section``, ``distributed_section``);
- :mod:`~ddp_rank.config.checks`: what the sections share: :class:`ConfigError`, the value types that read
  command-line text, the section base, and pydantic's errors translated into one-line messages;
- :mod:`~ddp_rank.config.loader`: defaults <- YAML file <- ``section.key=value`` overrides, validated once,
  :func:`save_config`, :func:`describe` (``--help-config``).

Import from here (``from ddp_rank.config import load_config``), not from the files. The package imports only
the standard library, PyYAML, pydantic and :mod:`ddp_rank.atomic_io`: never torch, so any layer may import it.
"""

from ddp_rank.config.checks import ConfigError
from ddp_rank.config.data_section import DataConfig
from ddp_rank.config.distributed_section import DistributedConfig
from ddp_rank.config.eval_section import EvalConfig
from ddp_rank.config.loader import (
    config_from_dict,
    describe,
    load_config,
    parse_overrides,
    save_config,
    to_dict,
)
from ddp_rank.config.loss_section import LossConfig
from ddp_rank.config.model_section import BACKBONES, FEATURES_BACKBONE, TIMM_PREFIX, ModelConfig
from ddp_rank.config.optim_section import OptimConfig
from ddp_rank.config.schema import Config, config_json_schema
from ddp_rank.config.train_section import TrainConfig

__all__ = [
    "BACKBONES",
    "FEATURES_BACKBONE",
    "TIMM_PREFIX",
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "TrainConfig",
    "config_from_dict",
    "config_json_schema",
    "describe",
    "load_config",
    "parse_overrides",
    "save_config",
    "to_dict",
]
