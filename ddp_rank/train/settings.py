"""The config translated once, for training: ``Config`` -> the settings of each part the trainer drives.

``Trainer(cfg)`` calls :func:`train_settings` at start-up and hands each part its own: the data stream the
config's ``data`` section (with ``Config.data_seed``), the network the ``model`` section, the loss the ``loss``
section, the optimizer the ``optim`` section, the checkpointing the ``train`` section; the step (batch layout,
chunk, BatchNorm, capture, clipping), the evaluation and the reporting, which read keys of several sections, their
settings. Below the trainer no module reads the whole config (``tests/test_settings.py`` keeps it so).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_rank.config import (
    Config,
    DataConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    save_config,
    to_dict,
)
from ddp_rank.eval.runner import EvalSettings
from ddp_rank.eval.settings import evaluation_settings
from ddp_rank.train.run_outputs import ConfigRecord
from ddp_rank.train.run_report import ReportSettings
from ddp_rank.train.step_settings import StepSettings

__all__ = [
    "TrainSettings",
    "config_record",
    "step_settings",
    "train_settings",
]


@dataclass(frozen=True)
class TrainSettings:
    """What the parts of one training run read (the trainer hands each part its own): the ``data``, ``model``,
    ``loss``, ``optim`` and ``train`` sections as they are, ``data_seed`` (``Config.data_seed``), and the
    settings of the step, the evaluation and the report."""

    data: DataConfig
    data_seed: int
    model: ModelConfig
    loss: LossConfig
    optim: OptimConfig
    step: StepSettings
    evaluation: EvalSettings
    train: TrainConfig
    report: ReportSettings


def config_record(cfg: Config) -> ConfigRecord:
    """The whole config as the run's outputs record it (``config.yaml``, ``meta.json``, ``run.json``)."""
    return ConfigRecord(
        values=to_dict(cfg), defaults=to_dict(Config()), write=lambda path: save_config(cfg, path)
    )


def step_settings(cfg: Config) -> StepSettings:
    """The step's settings: the ``data``, ``model``, ``distributed`` and ``optim`` sections as they are."""
    return StepSettings(cfg.data, cfg.model, cfg.distributed, cfg.optim)


def train_settings(cfg: Config) -> TrainSettings:
    """Every part's settings of a training run of ``cfg``."""
    step, record, evaluation = step_settings(cfg), config_record(cfg), evaluation_settings(cfg)
    return TrainSettings(
        data=cfg.data,
        data_seed=cfg.data_seed,
        model=cfg.model,
        loss=cfg.loss,
        optim=cfg.optim,
        step=step,
        evaluation=evaluation,
        train=cfg.train,
        # The reporting's: the train section, the evaluation's settings and the config record.
        report=ReportSettings(cfg.train, evaluation, record),
    )
