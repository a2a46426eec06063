"""The config translated once, for training: ``Config`` -> the settings of each part the trainer drives.

``Trainer(cfg)`` calls :func:`train_settings` at start-up and hands each part its own: the data stream the
config's ``data`` section (with ``Config.data_seed``), the network the ``model`` section, the loss, the
optimizer, the step (batch layout, chunk, BatchNorm, capture, clipping), the evaluation, the checkpointing and
the reporting their settings. Below the trainer no module reads the whole config (``tests/test_settings.py`` keeps
it so): a value enters in one place, here or in the evaluation's translation (``ddp_rank.eval.settings``).
``build_loss(cfg)`` and ``check_inputs(cfg)`` keep the config-level names the trainer module has exported.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_rank.config import Config, DataConfig, ModelConfig, save_config, to_dict
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.eval.runner import EvalSettings
from ddp_rank.eval.settings import evaluation_settings
from ddp_rank.losses import ListwiseLoss
from ddp_rank.train import setup
from ddp_rank.train.checkpoints.write import CheckpointSettings
from ddp_rank.train.optim import OptimSettings
from ddp_rank.train.run_outputs import ConfigRecord
from ddp_rank.train.run_report import ReportSettings
from ddp_rank.train.setup import LossSettings
from ddp_rank.train.step_settings import StepSettings
from ddp_rank.train.trackers import TrackerSettings

__all__ = [
    "TrainSettings",
    "build_loss",
    "check_inputs",
    "checkpoint_settings",
    "config_record",
    "loss_settings",
    "optim_settings",
    "report_settings",
    "step_settings",
    "tracker_settings",
    "train_settings",
]


@dataclass(frozen=True)
class TrainSettings:
    """Every part's settings of one training run (the trainer hands each part its own): the ``data`` and
    ``model`` sections as they are, ``data_seed`` (``Config.data_seed``), and the other parts' settings."""

    data: DataConfig
    data_seed: int
    model: ModelConfig
    loss: LossSettings
    optim: OptimSettings
    step: StepSettings
    evaluation: EvalSettings
    checkpoints: CheckpointSettings
    report: ReportSettings

    @property
    def tracking(self) -> TrackerSettings:
        return self.report.tracking


def config_record(cfg: Config) -> ConfigRecord:
    """The whole config as the run's outputs record it (``config.yaml``, ``meta.json``, ``run.json``)."""
    return ConfigRecord(
        values=to_dict(cfg), defaults=to_dict(Config()), write=lambda path: save_config(cfg, path)
    )


def loss_settings(cfg: Config) -> LossSettings:
    """The loss's settings: the ``loss`` section and ``model.embedding_dim``."""
    lc = cfg.loss
    return LossSettings(
        name=lc.name,
        miner=lc.miner,
        params_lr_mult=lc.params_lr_mult,
        num_bins=lc.num_bins,
        kernel=lc.kernel,
        matmul_precision=lc.matmul_precision,
        normalize=lc.normalize,
        memory_budget_mb=lc.memory_budget_mb,
        pnp_variant=lc.pnp_variant,
        tau=lc.tau,
        b=lc.b,
        alpha=lc.alpha,
        count_self=lc.count_self,
        embedding_dim=cfg.model.embedding_dim,
    )


def optim_settings(cfg: Config) -> OptimSettings:
    """The optimizer's settings: the ``optim`` section."""
    o = cfg.optim
    return OptimSettings(
        name=o.name,
        lr=o.lr,
        head_lr_mult=o.head_lr_mult,
        weight_decay=o.weight_decay,
        betas=tuple(o.betas),
        momentum=o.momentum,
        schedule=o.schedule,
        warmup_steps=o.warmup_steps,
        min_lr_ratio=o.min_lr_ratio,
        step_milestones=tuple(o.step_milestones),
        step_gamma=o.step_gamma,
        grad_clip=o.grad_clip,
    )


def step_settings(cfg: Config) -> StepSettings:
    """The step's settings: the batch, the chunk, BatchNorm, capture, clipping and reduction."""
    d, m, dist = cfg.data, cfg.model, cfg.distributed
    return StepSettings(
        global_batch_size=d.global_batch_size,
        image_size=d.image_size,
        sampler=d.sampler,
        images_per_class=d.images_per_class,
        fixed_chunk=dist.fixed_chunk,
        capture_chunk=dist.capture_chunk,
        memory_fraction=dist.memory_fraction,
        memory_budget_mb=dist.memory_budget_mb,
        grad_reduction=dist.grad_reduction,
        freeze_bn=m.freeze_bn,
        sync_bn=m.sync_bn,
        bn_group_size=m.bn_group_size,
        embedding_dim=m.embedding_dim,
        optimizer=cfg.optim.name,
        momentum=cfg.optim.momentum,
        grad_clip=cfg.optim.grad_clip,
    )


def checkpoint_settings(cfg: Config) -> CheckpointSettings:
    """The checkpointing's settings: ``train.resume``, ``force_resume``, ``keep_last``, ``checkpoint_every``,
    ``best_metric``."""
    t = cfg.train
    return CheckpointSettings(
        resume=t.resume,
        force_resume=t.force_resume,
        keep_last=t.keep_last,
        checkpoint_every=t.checkpoint_every,
        best_metric=t.best_metric,
    )


def tracker_settings(cfg: Config, config: ConfigRecord | None = None) -> TrackerSettings:
    """The experiment trackers' settings: ``train.log_with``, ``output_dir``, ``tracker_project``."""
    return TrackerSettings(
        log_with=tuple(cfg.train.log_with),
        output_dir=cfg.train.output_dir,
        tracker_project=cfg.train.tracker_project,
        config=config if config is not None else config_record(cfg),
    )


def report_settings(cfg: Config, evaluation: EvalSettings | None = None) -> ReportSettings:
    """The reporting's settings (``train.output_dir``, ``progress``, ``plots``, ``best_metric``,
    ``data.test_split``, the trackers, the retrieval picture's evaluation settings, the config record)."""
    record = config_record(cfg)
    return ReportSettings(
        output_dir=cfg.train.output_dir,
        progress=cfg.train.progress,
        plots=cfg.train.plots,
        best_metric=cfg.train.best_metric,
        test_split=cfg.data.test_split,
        tracking=tracker_settings(cfg, record),
        evaluation=evaluation if evaluation is not None else evaluation_settings(cfg),
        config=record,
    )


def train_settings(cfg: Config) -> TrainSettings:
    """Every part's settings of a training run of ``cfg``."""
    evaluation = evaluation_settings(cfg)
    return TrainSettings(
        data=cfg.data,
        data_seed=cfg.data_seed,
        model=cfg.model,
        loss=loss_settings(cfg),
        optim=optim_settings(cfg),
        step=step_settings(cfg),
        evaluation=evaluation,
        checkpoints=checkpoint_settings(cfg),
        report=report_settings(cfg, evaluation),
    )


def build_loss(cfg: Config) -> ListwiseLoss:
    """The listwise loss of ``cfg.loss`` (:func:`ddp_rank.train.setup.build_loss` on :func:`loss_settings`)."""
    return setup.build_loss(loss_settings(cfg))


def check_inputs(cfg: Config) -> Manifest:
    """The start-up checks of ``cfg``'s shards and evaluation
    (:func:`ddp_rank.train.setup.open_and_check_inputs`); returns the manifest."""
    return setup.open_and_check_inputs(evaluation_settings(cfg), cfg.model.backbone, cfg.train.best_metric)
