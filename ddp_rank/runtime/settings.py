"""The config translated once, for the parts below training and evaluation: ``Config`` -> each part's settings.

Every command turns its experiment config into the settings of the parts it drives at start-up, here and in
``ddp_rank.eval.settings`` (the evaluation's own, which cannot be made below the eval layer); the modules below
then take their part's settings and never the whole config (``tests/test_settings.py`` keeps it so). A value
read from the config is therefore read in one place, with its default and its resolution (``data.seed=-1``),
and a reader following one value finds where it enters.
"""

from __future__ import annotations

from typing import Any

from ddp_rank.config import Config
from ddp_rank.data.settings import DataSettings
from ddp_rank.model.settings import ModelSettings
from ddp_rank.runtime.accelerator import AcceleratorSettings, start_accelerator

__all__ = ["accelerator_settings", "data_seed", "data_settings", "make_accelerator", "model_settings"]


def data_seed(cfg: Config) -> int:
    """The seed of the data schedule, the dealing to ranks and the augmentations: ``data.seed``, or ``train.seed``
    when it is -1 (so one seed varies everything, and ``data.seed`` varies the data alone)."""
    return cfg.data.seed if cfg.data.seed >= 0 else cfg.train.seed


def data_settings(cfg: Config) -> DataSettings:
    """The data layer's settings: the ``data`` section, its seed resolved."""
    d = cfg.data
    return DataSettings(
        shards=d.shards,
        train_split=d.train_split,
        test_split=d.test_split,
        cache_dir=d.cache_dir,
        cache_max_gb=d.cache_max_gb,
        global_batch_size=d.global_batch_size,
        sampler=d.sampler,
        images_per_class=d.images_per_class,
        category_aware=d.category_aware,
        categories_per_batch=d.categories_per_batch,
        batches_per_pair=d.batches_per_pair,
        steps_per_epoch=d.steps_per_epoch,
        num_workers=d.num_workers,
        augment=d.augment,
        seed=data_seed(cfg),
        image_size=d.image_size,
        resize_size=d.resize_size,
        crop_scale_min=d.crop_scale_min,
        crop=d.crop,
        max_image_pixels=d.max_image_pixels,
    )


def accelerator_settings(cfg: Config) -> AcceleratorSettings:
    """The accelerator's settings: ``distributed.cpu``, ``train.mixed_precision``,
    ``distributed.find_unused_parameters``."""
    return AcceleratorSettings(
        cpu=cfg.distributed.cpu,
        mixed_precision=cfg.train.mixed_precision,
        find_unused_parameters=cfg.distributed.find_unused_parameters,
    )


def make_accelerator(cfg: Config, tracker_arguments: dict[str, Any] | None = None) -> Any:
    """An ``Accelerator`` for this machine and ``cfg`` (:func:`~ddp_rank.runtime.accelerator.start_accelerator`
    on :func:`accelerator_settings`). ``tracker_arguments``: the trainer's experiment trackers (``log_with`` and
    the logging directory, ``ddp_rank.train.trackers``)."""
    return start_accelerator(accelerator_settings(cfg), tracker_arguments)


def model_settings(cfg: Config) -> ModelSettings:
    """The model layer's settings: the ``model`` section, ``data.image_size`` and ``train.seed``."""
    m = cfg.model
    return ModelSettings(
        backbone=m.backbone,
        weights=m.weights,
        init_from=m.init_from,
        pooling=m.pooling,
        output_stride=m.output_stride,
        embedding_dim=m.embedding_dim,
        normalize=m.normalize,
        head_hidden=m.head_hidden,
        freeze_bn=m.freeze_bn,
        sync_bn=m.sync_bn,
        bn_group_size=m.bn_group_size,
        image_size=cfg.data.image_size,
        init_seed=cfg.train.seed,
    )
