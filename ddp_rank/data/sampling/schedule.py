"""The category schedule: which groups of data make up the global batch of step ``s`` of epoch ``e``.

It is a pure function of (seed, epoch, step), so every rank and every DataLoader worker computes the same
answer with no communication (FastAP supplement A); ``ddp_rank.data.sampling.plan`` then draws the classes of each group:

- ``hard``: every set of ``categories_per_batch`` categories (pairs by default) gets ``batches_per_pair`` steps
  per epoch, in a seeded order; each category fills an equal part of the global batch. SOP: 66 pairs x 5 = 330
  steps, In-Shop: 253 x 2 = 506. With ``steps_per_epoch`` set, each step draws its own random set instead
  (for many categories, where enumerating every set is too much).
- ``hard_unlabelled``: VehicleID, where only some classes have a category: half of each batch from one labelled
  category, half from the unlabelled pool; category c gets ceil(N_c / (B/2)) steps, sum_c 2 N_c / B in all.
- ``random``: classes from the whole split, ``N / B`` steps per epoch.
- ``pk``: P classes x K images (``images_per_class``); from the whole split (``N_K / B`` steps, N_K the images
  an epoch can give with at most K per class), or, with ``category_aware``, from the hard schedule's categories.

A step's entry is a tuple of group ids: a category id, ``UNLABELLED`` or ``ALL``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np

Strategy = Literal["hard", "hard_unlabelled", "random", "pk"]
STRATEGIES: tuple[str, ...] = ("hard", "hard_unlabelled", "random", "pk")
UNLABELLED = -1
"""Group id of the classes without a category."""
ALL = -2
"""Group id of the whole split (random strategy)."""
_MAX_ENUMERATED = 1_000_000


@dataclass(frozen=True)
class ScheduleConfig:
    """How batches draw categories (see the module docstring)."""

    strategy: Strategy = "hard"
    categories_per_batch: int = 2
    """Categories in each batch for ``hard`` (the paper found 2 best)."""
    batches_per_pair: int = 5
    """Steps per category set and epoch for ``hard`` (SOP 5, In-Shop 2)."""
    steps_per_epoch: int | None = None
    """Override the epoch length; for ``hard`` it switches to a fresh random category set per step."""
    images_per_class: int = 4
    """K of the ``pk`` strategy: images taken from each class (fewer when a class has fewer)."""
    category_aware: bool = False
    """``pk`` only: draw the classes from the hard schedule's categories instead of the whole split."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.images_per_class < 2:
            raise ValueError(
                f"images_per_class must be at least 2 (a class needs a positive), got {self.images_per_class}"
            )
        if self.categories_per_batch < 1 or self.batches_per_pair < 1:
            raise ValueError("categories_per_batch and batches_per_pair must be at least 1")
        if self.steps_per_epoch is not None and self.steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch must be at least 1, got {self.steps_per_epoch}")
        if self.steps_per_epoch is not None and self.strategy == "hard_unlabelled":
            raise ValueError(
                "steps_per_epoch cannot be set with the hard_unlabelled strategy: its epoch visits every labelled "
                "category once (FastAP supplement A); leave steps_per_epoch unset"
            )


class CategorySchedule:
    """Step -> groups, for one split's categories. ``category_sizes`` maps category id -> images in the split."""

    def __init__(
        self,
        config: ScheduleConfig,
        category_sizes: Mapping[int, int],
        global_batch: int,
        unlabelled_size: int = 0,
        total_size: int | None = None,
    ) -> None:
        self.config = config
        self.categories = tuple(sorted(c for c, n in category_sizes.items() if n > 0))
        self.category_sizes = dict(category_sizes)
        self.global_batch = global_batch
        self.unlabelled_size = unlabelled_size
        self.total_size = (
            total_size if total_size is not None else sum(category_sizes.values()) + unlabelled_size
        )
        self._check()
        self._orders: dict[
            int, tuple[tuple[int, ...], ...]
        ] = {}  # epoch -> step order (a plain dict pickles)

    def _check(self) -> None:
        cfg = self.config
        if self.by_category and len(self.categories) < cfg.categories_per_batch:
            raise ValueError(
                f"hard strategy needs {cfg.categories_per_batch} categories per batch but only "
                f"{len(self.categories)} can fill their share"
                + (f" (category ids {list(self.categories)})" if self.categories else "")
                + "; use a smaller "
                "data.categories_per_batch or data.global_batch_size, or draw classes from the whole split with "
                "data.sampler=random"
            )
        if cfg.strategy == "hard_unlabelled" and (not self.categories or self.unlabelled_size == 0):
            raise ValueError("hard_unlabelled needs labelled categories AND unlabelled classes in the split")

    @property
    def by_category(self) -> bool:
        """True when steps draw categories (hard, or category-aware pk)."""
        return self.config.strategy == "hard" or (self.config.strategy == "pk" and self.config.category_aware)

    @property
    def group_count(self) -> int:
        """Groups per step (each fills an equal part of the batch)."""
        if self.by_category:
            return self.config.categories_per_batch
        return 2 if self.config.strategy == "hard_unlabelled" else 1

    @property
    def steps_per_epoch(self) -> int:
        cfg = self.config
        if cfg.steps_per_epoch is not None:
            return cfg.steps_per_epoch
        if self.by_category:
            return math.comb(len(self.categories), cfg.categories_per_batch) * cfg.batches_per_pair
        if cfg.strategy == "hard_unlabelled":
            half = max(1, self.global_batch // 2)
            return sum(math.ceil(self.category_sizes[c] / half) for c in self.categories)
        return max(1, self.total_size // self.global_batch)

    def step(self, epoch: int, step: int) -> tuple[int, ...]:
        """The groups of (epoch, step); the same on every rank and worker."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside epoch of {self.steps_per_epoch} steps")
        cfg = self.config
        if not self.by_category and cfg.strategy != "hard_unlabelled":
            return (ALL,)
        if self.by_category and cfg.steps_per_epoch is not None:
            rng = np.random.default_rng([cfg.seed, epoch, step, 1])
            picked = rng.choice(len(self.categories), size=cfg.categories_per_batch, replace=False)
            return tuple(self.categories[i] for i in sorted(picked))
        if epoch not in self._orders:
            self._orders = {epoch: self._epoch_order(epoch)}  # keep one epoch: steps are asked in order
        return self._orders[epoch][step]

    def _epoch_order(self, epoch: int) -> tuple[tuple[int, ...], ...]:
        cfg = self.config
        if self.by_category:
            n_sets = math.comb(len(self.categories), cfg.categories_per_batch)
            if n_sets * cfg.batches_per_pair > _MAX_ENUMERATED:
                raise ValueError(
                    f"{n_sets} category sets x {cfg.batches_per_pair} is too many steps to enumerate; "
                    "set steps_per_epoch to draw a random set per step"
                )
            sets = list(itertools.combinations(self.categories, cfg.categories_per_batch))
            steps: list[tuple[int, ...]] = sets * cfg.batches_per_pair
        else:
            steps = [
                (c, UNLABELLED)
                for c in self.categories
                for _ in range(math.ceil(self.category_sizes[c] / max(1, self.global_batch // 2)))
            ]
        order = np.random.default_rng([cfg.seed, epoch, 0]).permutation(len(steps))
        return tuple(steps[i] for i in order)


def group_quotas(global_batch: int, groups: int, step: int) -> list[int]:
    """Images each of a step's groups gives the global batch: an equal split, the remainder rotating with the
    step so that no group is favoured over an epoch."""
    base, extra = divmod(global_batch, groups)
    return [base + (1 if (i - step) % groups < extra else 0) for i in range(groups)]
