"""The bridge from the typed config to the data layer's settings (the data layer itself knows no config)."""

from __future__ import annotations

from ddp_rank.config import Config
from ddp_rank.data.schedule import ScheduleConfig


def schedule_config(cfg: Config) -> ScheduleConfig:
    """The sampler settings of ``cfg.data`` (seeded by :func:`data_seed`)."""
    data = cfg.data
    return ScheduleConfig(
        strategy=data.sampler,  # type: ignore[arg-type]
        categories_per_batch=data.categories_per_batch,
        batches_per_pair=data.batches_per_pair,
        steps_per_epoch=data.steps_per_epoch or None,
        images_per_class=data.images_per_class,
        category_aware=data.category_aware,
        seed=data_seed(cfg),
    )


def data_seed(cfg: Config) -> int:
    """The seed of the data schedule, the dealing to ranks and the augmentations: ``data.seed``, or ``train.seed``
    when it is -1 (so one seed varies everything, and ``data.seed`` varies the data alone)."""
    return cfg.data.seed if cfg.data.seed >= 0 else cfg.train.seed
