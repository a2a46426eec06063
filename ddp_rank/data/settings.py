"""The data layer's settings for one run: which shards, how a global batch is drawn, how an image becomes pixels.

The data layer knows no experiment config: at start-up ``ddp_rank.runtime.settings.data_settings`` copies the
config's ``data`` section (and ``train.seed`` where ``data.seed`` is -1) into one :class:`DataSettings`, and the
stream, the sampler, the evaluation's reader and the shard checks take it from there. The field names are the
config keys', so a value is found under the same name in the YAML, ``--help-config`` and here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddp_rank.data.reading.transforms import TransformConfig, transform_from_config

__all__ = ["DataSettings"]


@dataclass(frozen=True)
class DataSettings:
    """What the data layer reads of a run, from the config keys ``data.*`` of the same names; ``seed`` is
    ``data.seed`` resolved (``train.seed`` when ``data.seed`` is -1): the seed of the schedule, of the dealing to
    the ranks and of the augmentations."""

    shards: str = ""
    train_split: str = "train"
    test_split: str = "test"
    cache_dir: str = ""
    cache_max_gb: float = 0.0
    global_batch_size: int = 256
    sampler: str = "auto"
    images_per_class: int = 4
    category_aware: bool = False
    categories_per_batch: int = 2
    batches_per_pair: int = 5
    steps_per_epoch: int = 0
    num_workers: int = 2
    augment: bool = True
    seed: int = 0
    image_size: int = 224
    resize_size: int = 256
    crop_scale_min: float = 0.08
    crop: str = "random_resized"
    max_image_pixels: int = 89_478_485

    def transform(self, *, augment: bool = False, pixels: str = "float") -> TransformConfig:
        """The image transform at these sizes (``augment``: the training crop and flip; ``pixels``: ``float`` in
        [0, 1] or ``uint8``); see :func:`~ddp_rank.data.reading.transforms.transform_from_config`."""
        return transform_from_config(self, augment=augment, pixels=pixels)
