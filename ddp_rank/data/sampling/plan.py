"""One global sampling plan per step (the dealing of a step to the ranks is ``dealing``).

The global batch of step ``s`` of epoch ``e`` is a pure function of (seed, epoch, step, the manifest's split,
the sampler settings): every rank computes it from the manifest alone, with no communication, and it does not
depend on the world size or on the DataLoader workers. So one GPU (chunked) and 64 GPUs train on the same
sequence of global batches, and a resume continues it on any layout.

Per step, the schedule (``schedule.CategorySchedule``) names the groups: categories for ``hard`` (FastAP
sec. 4.2 and supplement A), one category and the unlabelled pool for ``hard_unlabelled`` (VehicleID), the whole
split for ``random`` and ``pk``. Each group has a cursor over its classes: a fresh random permutation per pass,
classes taken in that order without replacement within the epoch until the group's share of the batch is full
(whole classes where they fit; a class cut at the end keeps its rest, at least 2 images, first in line for the
group's next step). ``pk`` takes at most K images of each class. Every group restarts at each epoch, so step s
is found by replaying the epoch's earlier steps (pure arithmetic on class sizes, no image is read).

``dealing.deal`` then cuts the step's pieces into W parts of exactly M / W images; rank r reads only its part.

Each piece names its images as indices into the class's samples in stored order (its ``ClassSpan``s in manifest
order), so a rank reads one byte range per span of the class (one per class in ddp_rank's own layout). ``reserve`` lists, per step and group, classes outside the step's plan that
replace a class a rank cannot read: rank r takes every W-th candidate from position r, so ranks never pick the
same replacement and never need to ask each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.sampling.pack import PackError, cut, pack
from ddp_rank.data.sampling.schedule import ALL, UNLABELLED, CategorySchedule, ScheduleConfig, group_quotas


class PlanError(ValueError):
    """The sampler settings cannot be met by these shards; the message says why and what to change."""


def local_batch_size(global_batch: int, world_size: int) -> int:
    """Each rank's share of a global batch: every rank holds exactly ``global_batch / world_size`` images (the
    one definition the dealing, the stream and the trainer's layout share); raises PlanError when it does not
    divide."""
    if world_size < 1:
        raise PlanError(f"world_size must be at least 1, got {world_size}")
    if global_batch % world_size:
        raise PlanError(
            f"a global batch of {global_batch} images is not divisible by {world_size} ranks: every rank must "
            "hold the same number of images"
        )
    return global_batch // world_size


class Piece(NamedTuple):
    """Images of one class in a step: ``images`` are indices into the class's stored samples (a ``range`` for
    a whole class). A named tuple: a 65,536-image step has thousands of them."""

    class_id: int
    images: Sequence[int]
    group: int

    @property
    def size(self) -> int:
        return len(self.images)


@dataclass(frozen=True)
class StepPlan:
    """The global batch of one step: its groups and pieces (pieces of a group are contiguous)."""

    epoch: int
    step: int
    groups: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def size(self) -> int:
        return sum(p.size for p in self.pieces)


@dataclass(frozen=True)
class Catalog:
    """The classes of one split that the plan may draw (at least 2 images each), from the manifest alone."""

    class_sizes: Mapping[int, int]
    class_group: Mapping[int, int]
    """Category id, or UNLABELLED for classes without one."""
    category_names: Sequence[str]
    singletons: int = 0
    """Classes left out because they have a single image (no positive: nothing to learn from)."""

    @classmethod
    def of(
        cls, counts: Mapping[int, int], groups: Mapping[int, int], category_names: Sequence[str]
    ) -> Catalog:
        """From every class's image count and group; classes of fewer than 2 images are left out (counted)."""
        sizes = {cid: n for cid, n in counts.items() if n >= 2}
        return cls(
            sizes, {cid: groups[cid] for cid in sizes}, category_names, singletons=len(counts) - len(sizes)
        )

    @classmethod
    def from_manifest(cls, manifest: Manifest, split: str) -> Catalog:
        counts = manifest.split(split).class_counts
        groups = {
            cid: UNLABELLED
            if manifest.classes[cid].category is None
            else int(manifest.classes[cid].category or 0)
            for cid in counts
        }
        return cls.of(counts, groups, manifest.categories)

    @cached_property
    def _by_group(self) -> dict[int, np.ndarray]:
        ids = np.array(sorted(self.class_group), dtype=np.int64)
        groups = np.array([self.class_group[int(c)] for c in ids], dtype=np.int64)
        return {int(g): ids[groups == g] for g in np.unique(groups)} | {ALL: ids}

    @cached_property
    def size_array(self) -> np.ndarray:
        """Images per class id (0 for ids not drawn), for vectorised lookups."""
        sizes = np.zeros(max(self.class_sizes, default=-1) + 1, dtype=np.int64)
        for cid, n in self.class_sizes.items():
            sizes[cid] = n
        return sizes

    def members(self, group: int) -> np.ndarray:
        """Class ids of a group (ALL: every class), sorted."""
        return self._by_group.get(group, np.zeros(0, dtype=np.int64))

    def images(self, group: int, cap: int | None = None) -> int:
        sizes = self.size_array[self.members(group)]
        return int(np.minimum(sizes, cap).sum() if cap else sizes.sum())


@dataclass
class LeftOut:
    """A category the schedule cannot use, and why (images a step needs vs images it has)."""

    name: str
    needed: int
    available: int

    def __str__(self) -> str:
        return f"{self.name}: a step needs {self.needed} images, it has {self.available}"


@dataclass
class _Cursor:
    """Where a group stands in the current epoch: pending pieces (rests of cut classes, classes passed over),
    then the fresh classes of the current pass from ``position`` on."""

    order: np.ndarray
    position: int = 0
    passes: int = 0
    pending: list[tuple[int, Sequence[int]]] = field(default_factory=list)


class GlobalPlan:
    """Steps -> global batches for one split (see the module docstring).

    Args:
        catalog: the split's classes (``Catalog.from_manifest``).
        config: the sampler settings (strategy, categories per batch, K, seed, ...).
        global_batch: M, images per step over all ranks.
    """

    def __init__(self, catalog: Catalog, config: ScheduleConfig, global_batch: int) -> None:
        self.catalog = catalog
        self.config = config
        self.global_batch = global_batch
        self.cap = config.images_per_class if config.strategy == "pk" else None
        self.left_out: list[LeftOut] = []
        self.schedule = self._schedule()
        self._members = {g: self.catalog.members(g) for g in self._groups()}
        sizes = self.catalog.size_array
        self._sizes = np.minimum(sizes, self.cap) if self.cap else sizes
        self._state: tuple[int, int, dict[int, _Cursor]] | None = None
        self._last: StepPlan | None = None

    # ------------------------------------------------------------------ set-up

    def _schedule(self) -> CategorySchedule:
        cfg, cat = self.config, self.catalog
        categories = sorted({g for g in cat.class_group.values() if g != UNLABELLED})
        by_category = cfg.strategy == "hard" or (cfg.strategy == "pk" and cfg.category_aware)
        groups = cfg.categories_per_batch if by_category else 2 if cfg.strategy == "hard_unlabelled" else 1
        need = -(-self.global_batch // groups)
        if need < 2:
            raise PlanError(
                f"global batch {self.global_batch} split over {groups} groups leaves fewer than 2 images per group"
            )
        sizes: dict[int, int] = {}
        for c in categories:
            have = cat.images(c, self.cap)
            if (by_category or cfg.strategy == "hard_unlabelled") and have < need:
                self.left_out.append(LeftOut(cat.category_names[c], need, have))
                continue
            sizes[c] = have
        unlabelled = cat.images(UNLABELLED, self.cap)
        total = cat.images(ALL, self.cap)
        if cfg.strategy == "hard_unlabelled" and unlabelled < need:
            raise PlanError(
                f"hard_unlabelled needs {need} unlabelled images per step, the split has {unlabelled}; use a "
                "smaller global batch"
            )
        if not by_category and cfg.strategy != "hard_unlabelled" and total < self.global_batch:
            raise PlanError(
                f"the split has {total} usable images"
                + (f" (at most K={self.cap} per class)" if self.cap else "")
                + f", fewer than one global batch of {self.global_batch}; use a smaller data.global_batch_size"
            )
        if by_category and len(sizes) < cfg.categories_per_batch:
            raise PlanError(self._too_few_categories(len(categories), len(sizes), need))
        try:
            return CategorySchedule(
                cfg, sizes, self.global_batch, unlabelled_size=unlabelled, total_size=total
            )
        except ValueError as exc:
            detail = "; ".join(str(x) for x in self.left_out[:5])
            if len(self.left_out) > 5:
                detail += f"; and {len(self.left_out) - 5} more"
            raise PlanError(f"{exc}" + (f" (left out: {detail})" if detail else "")) from exc

    def _too_few_categories(self, found: int, usable: int, need: int) -> str:
        """Why a category-drawing sampler cannot start: the split has no categories at all, or too few of them
        hold a step's share of ``need`` images (those named, with what they hold)."""
        cfg = self.config
        sampler = (
            "data.sampler=hard" if cfg.strategy == "hard" else "data.sampler=pk with data.category_aware"
        )
        # What draws from the whole split instead: for pk, dropping its category constraint; for hard, random
        # (auto picks random only where the split has no categories at all: elsewhere it would pick hard again).
        if cfg.strategy != "hard":
            whole_split = "draw classes from the whole split with data.category_aware=false"
        elif found == 0:
            whole_split = "draw classes from the whole split with data.sampler=auto (random here, or pk)"
        else:
            whole_split = "draw classes from the whole split with data.sampler=random (or pk)"
        if found == 0:
            return (
                f"{sampler} draws each batch from {cfg.categories_per_batch} categories, but the split's classes "
                "have none (shards built from root/<class>/<image>, or indexed without a category field): "
                f"{whole_split}, or rebuild the shards from root/<category>/<class>/<image>"
            )
        if not self.left_out:
            return (
                f"{sampler} needs {cfg.categories_per_batch} categories per batch, but the split has only "
                f"{found}: use a smaller data.categories_per_batch, or {whole_split}"
            )
        shown = "; ".join(str(x) for x in self.left_out[:3])
        if len(self.left_out) > 3:
            shown += f"; and {len(self.left_out) - 3} more"
        return (
            f"{sampler} needs {cfg.categories_per_batch} categories per batch, each holding a step's share of "
            f"{need} images, but only {usable} of the split's {found} do (too small: {shown}); use a smaller "
            f"data.categories_per_batch or data.global_batch_size, or {whole_split}"
        )

    def _groups(self) -> list[int]:
        if self.schedule.by_category or self.config.strategy == "hard_unlabelled":
            groups = list(self.schedule.categories)
            return groups + ([UNLABELLED] if self.config.strategy == "hard_unlabelled" else [])
        return [ALL]

    @property
    def steps_per_epoch(self) -> int:
        return self.schedule.steps_per_epoch

    # ------------------------------------------------------------------ steps

    def step(self, epoch: int, step: int) -> StepPlan:
        """The global batch of (epoch, step). Steps asked in order cost one step each; any other order
        replays the epoch from its start (arithmetic only)."""
        if not 0 <= step < self.steps_per_epoch:
            raise IndexError(f"step {step} outside an epoch of {self.steps_per_epoch} steps")
        if self._last is not None and (self._last.epoch, self._last.step) == (epoch, step):
            return self._last
        if self._state is None or self._state[0] != epoch or self._state[1] > step:
            self._state = (epoch, 0, {})
        _, next_step, cursors = self._state
        plan = None
        for s in range(next_step, step + 1):
            plan = self._draw(epoch, s, cursors)
        self._state = (epoch, step + 1, cursors)
        assert plan is not None
        self._last = plan
        return plan

    def _draw(self, epoch: int, step: int, cursors: dict[int, _Cursor]) -> StepPlan:
        groups = self.schedule.step(epoch, step)
        quotas = group_quotas(self.global_batch, len(groups), step)
        pieces: list[Piece] = []
        for group, quota in zip(groups, quotas):
            if group not in cursors:
                cursors[group] = _Cursor(self._permutation(epoch, group, 0))
            pieces.extend(self._take(epoch, group, quota, cursors[group]))
        return StepPlan(epoch, step, groups, tuple(pieces))

    def _permutation(self, epoch: int, group: int, passes: int) -> np.ndarray:
        rng = np.random.default_rng([self.config.seed, epoch, group + 2, passes, 11])
        return rng.permutation(self._members[group])

    def _take(self, epoch: int, group: int, quota: int, cursor: _Cursor) -> list[Piece]:
        """``quota`` images of ``group``: pending pieces first, then fresh classes in the pass's order."""
        pending = cursor.pending
        fresh = self._fresh(epoch, group, cursor, quota // 2 + 64)
        fresh_sizes = self._sizes[fresh]
        # A class may show up twice in the window (pending rest + a later pass, or two passes of a small
        # group): only its first appearance is a candidate.
        repeat = np.isin(fresh, np.array([c for c, _ in pending], dtype=np.int64))
        first = np.unique(fresh, return_index=True)[1]
        later = np.ones(len(fresh), dtype=bool)
        later[first] = False
        repeat |= later
        fresh_sizes[repeat] = 0
        sizes = np.concatenate([np.array([len(im) for _, im in pending], dtype=np.int64), fresh_sizes])
        if pending and int(sizes.sum()) < quota:
            # A small group whose waiting rests hide their own classes' next pass: drop the rests, so the
            # classes come back whole (a group that qualified holds at least ``quota`` images).
            cursor.pending = []
            return self._take(epoch, group, quota, cursor)
        taken = {i: t for i, t in self._fill(sizes, quota, epoch, group) if t > 0}
        pieces: list[Piece] = []
        kept: list[tuple[int, Sequence[int]]] = []
        # One generator per take (seeded by where the cursor stands) draws the image subsets of cut classes.
        rng = np.random.default_rng([self.config.seed, epoch, group + 2, cursor.passes, cursor.position, 13])
        for i, (cid, images) in enumerate(pending):
            t = taken.get(i, 0)
            if t:
                pieces.append(Piece(cid, images[:t], group))
            if len(images) - t >= 2:
                kept.append((cid, images[t:]))
        consumed = max(0, max(taken) + 1 - len(pending))
        for j in range(consumed):
            if repeat[j]:
                continue
            cid, size = int(fresh[j]), int(fresh_sizes[j])
            t = taken.get(len(pending) + j, 0)
            whole = t == size == self.catalog.class_sizes[cid]
            images = range(size) if whole else self._images_of(rng, cid)
            if t:
                pieces.append(Piece(cid, images[:t], group))
            if len(images) - t >= 2 and (t == 0 or self.cap is None):
                kept.append((cid, images[t:]))  # a cut class's rest, or a class passed over
            # (a rest of 1 image is left out until the class's next pass: alone it has no positive)
        cursor.pending = kept
        cursor.position += consumed
        return pieces

    def _fill(self, sizes: np.ndarray, quota: int, epoch: int, group: int) -> list[tuple[int, int]]:
        """``pack``'s choice: keeping every rest >= 2 if possible, else letting a class's last image wait for
        its next pass, else (class sizes that cannot add up, like an odd share of pairs) a plain cut."""
        for drop in (False, True):
            try:
                return pack(sizes, quota, drop=drop)
            except PackError:
                continue
        try:
            return cut(sizes, quota)
        except PackError as exc:
            raise PlanError(f"epoch {epoch}: {self._group_name(group)}: {exc}") from exc

    def _fresh(self, epoch: int, group: int, cursor: _Cursor, need: int) -> np.ndarray:
        """The next ``need`` fresh classes of the group (fewer only if the group is smaller); a new pass, a
        fresh permutation, is appended when this one runs out, with the classes still waiting moved to its end
        so a class is not drawn twice in quick succession."""
        members = self._members[group]
        while len(cursor.order) - cursor.position < need and len(cursor.order) - cursor.position < 4 * len(
            members
        ):
            cursor.passes += 1
            rest = cursor.order[cursor.position :]
            nxt = self._permutation(epoch, group, cursor.passes)
            waiting = np.isin(
                nxt, np.concatenate([rest, np.array([c for c, _ in cursor.pending], dtype=np.int64)])
            )
            cursor.order = np.concatenate([rest, nxt[~waiting], nxt[waiting]])
            cursor.position = 0
        return cursor.order[cursor.position : cursor.position + need]

    def _images_of(self, rng: np.random.Generator, class_id: int) -> tuple[int, ...]:
        """The images of a class in a random order (a cut takes a random subset); ``pk`` keeps K of them."""
        order = rng.permutation(int(self.catalog.class_sizes[class_id]))
        return tuple(order[: self.cap].tolist() if self.cap else order.tolist())

    def _group_name(self, group: int) -> str:
        if group == ALL:
            return "(all classes)"
        if group == UNLABELLED:
            return "(unlabelled)"
        return self.catalog.category_names[group]

    # ------------------------------------------------------------------ replacement

    def reserve(self, epoch: int, step: int, group: int, rank: int, world_size: int) -> list[int]:
        """Replacement candidates of ``group`` for rank ``rank`` at (epoch, step): classes outside the step's
        plan, in a seeded order, every ``world_size``-th from position ``rank`` (disjoint across ranks)."""
        plan = self.step(epoch, step)
        used = {p.class_id for p in plan.pieces}
        members = self._members.get(group)
        if members is None:
            return []
        rng = np.random.default_rng([self.config.seed, epoch, step, group + 2, 17])
        order = [int(c) for c in rng.permutation(members) if int(c) not in used]
        return order[rank::world_size]

    def class_size(self, class_id: int) -> int:
        return int(self.catalog.class_sizes[class_id])
