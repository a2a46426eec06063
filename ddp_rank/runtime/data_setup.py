"""The data layer's sampler settings for a run's shards: ``data.sampler=auto`` resolved on the manifest."""

from __future__ import annotations

from ddp_rank.config import DataConfig
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.sampling.schedule import ScheduleConfig

__all__ = ["resolve_sampler", "schedule_config"]


def resolve_sampler(data: DataConfig, manifest: Manifest) -> tuple[str, str]:
    """(strategy, why) of ``data.sampler`` on the training split of ``manifest``. ``auto`` is the category-aware
    ``hard`` sampler when the split's classes span enough categories for a batch (at least two, and at least
    ``data.categories_per_batch``), else ``random``: shards made by other tools often carry no category."""
    if data.sampler != "auto":
        return data.sampler, "set by data.sampler"
    split = manifest.splits.get(data.train_split)
    counts = split.class_counts if split is not None else {}
    categories = {manifest.classes[c].category for c in counts} - {None}
    need = max(2, data.categories_per_batch)
    found = (
        f"split '{data.train_split}' has {len(categories)} categor{'y' if len(categories) == 1 else 'ies'}"
    )
    if len(categories) >= need:
        return "hard", f"data.sampler=auto: {found}, so each batch takes {data.categories_per_batch} of them"
    return "random", (
        f"data.sampler=auto: {found} (the category-aware sampler needs {need}), so classes are drawn at random "
        "from the whole split"
    )


def schedule_config(data: DataConfig, manifest: Manifest, seed: int) -> ScheduleConfig:
    """The sampler settings of the ``data`` section on ``manifest`` (``auto`` resolved), drawn with ``seed``
    (``Config.data_seed``: ``data.seed``, or ``train.seed`` when it is -1)."""
    return ScheduleConfig(
        strategy=resolve_sampler(data, manifest)[0],  # type: ignore[arg-type]
        categories_per_batch=data.categories_per_batch,
        batches_per_pair=data.batches_per_pair,
        steps_per_epoch=data.steps_per_epoch or None,
        images_per_class=data.images_per_class,
        category_aware=data.category_aware,
        seed=seed,
    )
