"""Typed experiment configuration: dataclasses loaded from YAML with ``key=value`` overrides.

Three files, one job each:

- :mod:`~ddp_rank.config.schema`: the sections (one dataclass per layer, each field with its doc, choices and
  bounds) and :class:`Config`, with the checks within and across sections;
- :mod:`~ddp_rank.config.checks`: what the sections share: :class:`ConfigError`, the field metadata and the
  generic checks of choices and bounds made from it;
- :mod:`~ddp_rank.config.loader`: defaults <- YAML file <- ``section.key=value`` overrides, type coercion,
  unknown keys rejected with the valid ones, :func:`save_config`, :func:`describe` (``--help-config``).

Import from here (``from ddp_rank.config import load_config``), not from the files. The package imports only
the standard library, PyYAML and :mod:`ddp_rank.atomic_io`: never torch, so any layer may import it.
"""

from ddp_rank.config.checks import ConfigError
from ddp_rank.config.loader import (
    config_from_dict,
    describe,
    load_config,
    parse_overrides,
    save_config,
    to_dict,
)
from ddp_rank.config.schema import (
    BACKBONES,
    FEATURES_BACKBONE,
    TIMM_PREFIX,
    Config,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)

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
    "describe",
    "load_config",
    "parse_overrides",
    "save_config",
    "to_dict",
]
