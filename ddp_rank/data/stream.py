"""The category-aware distributed stream: whole local batches, the same categories on every rank at each step.

Per step ``s`` of epoch ``e``, every rank asks the schedule for the step's groups (pure function, no
communication), takes its quota of each group from its own disjoint share (``packing``) and yields ONE batch of
exactly ``global_batch / world_size`` images. Under a DataLoader with ``batch_size=None`` and W workers, worker
w produces steps start + w, start + w + W, ... so the loader's round-robin order is the step order. Every rank
yields exactly ``steps_per_epoch`` batches per epoch and never runs dry (shares are streamed in passes), so data
parallel ranks can never hang on an uneven epoch end.

Data shares belong to virtual slots (rank, s mod W), not to physical workers, and the packing of skipped steps is
replayed from the shard index, so ``load_state_dict({"epoch": e, "step": s})`` continues exactly where an
uninterrupted run would be.

Each yielded batch is a dict: ``images`` float32 [n, 3, H, W], ``labels`` / ``categories`` int64 [n] (global ids
from the manifest; category -1 = unlabelled), ``keys`` (sample keys, unique within the split), ``epoch``,
``step``, ``groups`` (the schedule's groups) and ``stats`` (this slot's counts of bad shards, dropped samples and
undecodable images so far, with the bad shard names).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ddp_rank.data.manifest import Manifest, ShardInfo
from ddp_rank.data.packing import Packer, Ref, Unit, assign_shares, class_stream, share_size
from ddp_rank.data.schedule import (
    ALL,
    UNLABELLED,
    CategorySchedule,
    ScheduleConfig,
    group_quotas,
    max_quota,
    virtual_worker,
)
from ddp_rank.data.tario import MemberReader, SampleEntry, ShardScan, scan_shard
from ddp_rank.data.transforms import (
    TransformConfig,
    decode_image,
    normalize_batch,
    test_transform,
    train_transform,
)


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Explicit values first, then an initialised process group, then RANK / WORLD_SIZE, else (0, 1)."""
    if rank is not None and world_size is not None:
        found = (rank, world_size)
    elif dist.is_available() and dist.is_initialized():
        found = (dist.get_rank(), dist.get_world_size())
    else:
        found = (int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)))
    r, w = (rank if rank is not None else found[0]), (world_size if world_size is not None else found[1])
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is not in [0, world_size={w})")
    return r, w


@dataclass
class StreamStats:
    """What this slot had to skip; reported in every batch (worker processes cannot share a counter)."""

    bad_shards: list[str] = field(default_factory=list)
    dropped_samples: int = 0
    decode_errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "bad_shards": len(self.bad_shards),
            "bad_shard_names": list(self.bad_shards),
            "dropped_samples": self.dropped_samples,
            "decode_errors": self.decode_errors,
        }


class ShardStream(IterableDataset):
    """Category-aware, rank-disjoint stream of whole local batches from a shard directory.

    Args:
        shards: the shard directory (or its loaded ``Manifest``).
        global_batch: images per step over ALL ranks; each rank yields ``global_batch / world_size``.
        split: the manifest split to stream.
        schedule: strategy, categories per batch, batches per pair, seed (``ScheduleConfig``).
        transform: image sizes (``TransformConfig``); ``augment`` picks the train (random) or test transform.
        num_workers: the DataLoader's worker count; it must match, because data shares are cut per worker.
        rank, world_size: default to the process group, else RANK / WORLD_SIZE, else 0 / 1.
        lookahead: classes the packer may look ahead to fill a batch part exactly with paired images.
        class_window: classes shuffled together while reading a shard (bigger: more random, less sequential).

    One ``iter`` yields the rest of the current epoch. ``StreamLoader`` wraps the DataLoader and moves the
    position on as it hands out batches; with a raw ``DataLoader(stream, batch_size=None, num_workers=...)``
    call ``advance(batch)`` (or ``set_epoch``) yourself, since worker copies cannot report back.
    """

    def __init__(
        self,
        shards: str | os.PathLike[str] | Manifest,
        global_batch: int,
        *,
        split: str = "train",
        schedule: ScheduleConfig | None = None,
        transform: TransformConfig | None = None,
        augment: bool = True,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        lookahead: int = 32,
        class_window: int = 16,
    ) -> None:
        super().__init__()
        self.manifest = shards if isinstance(shards, Manifest) else Manifest.load(shards)
        self.split = split
        self.shards: tuple[ShardInfo, ...] = self.manifest.split(split).shards
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        if global_batch % self.world_size:
            raise ValueError(
                f"global_batch {global_batch} is not divisible by world_size {self.world_size}: every rank must "
                "hold the same number of images"
            )
        self.global_batch = global_batch
        self.local_batch = global_batch // self.world_size
        self.num_workers = num_workers
        self.workers = max(1, num_workers)
        self.n_slots = self.world_size * self.workers
        self.schedule_config = schedule or ScheduleConfig()
        self.transform_config = transform or TransformConfig()
        self.augment = augment
        self.lookahead = lookahead
        self.class_window = class_window
        self.skipped_categories: list[str] = []
        self.shares = self._eligible_shares()
        self.schedule = self._make_schedule()
        self._position = (0, 0)
        self.stats = StreamStats()
        self._class_category = np.array(
            [-1 if c.category is None else c.category for c in self.manifest.classes], dtype=np.int64
        )

    # ---------------------------------------------------------------- set-up

    def _groups_needed(self) -> list[int]:
        strategy = self.schedule_config.strategy
        labelled = sorted({s.category for s in self.shards if s.category is not None})
        if strategy == "random":
            return [ALL]
        return labelled + ([UNLABELLED] if strategy == "hard_unlabelled" else [])

    def _eligible_shares(self) -> dict[int, list[list[Unit]]]:
        """Shares for every group that can fill its quota on every slot; too-small categories are left out."""
        strategy = self.schedule_config.strategy
        groups = {"random": 1, "hard_unlabelled": 2}.get(strategy, self.schedule_config.categories_per_batch)
        need = max_quota(self.local_batch, groups)
        shares: dict[int, list[list[Unit]]] = {}
        for group in self._groups_needed():
            slots = assign_shares(self.shards, group, self.n_slots)
            smallest = min(share_size(self.shards, s) for s in slots)
            if smallest >= need:
                shares[group] = slots
                continue
            name = {ALL: "the split", UNLABELLED: "the unlabelled pool"}.get(
                group
            ) or self.manifest.categories[group]
            message = (
                f"{name} cannot give each of the {self.n_slots} (rank, worker) slots {need} images per batch "
                f"(smallest share: {smallest})"
            )
            if group in (ALL, UNLABELLED):
                raise ValueError(f"{message}; use a smaller global batch or fewer workers")
            self.skipped_categories.append(name)
            warnings.warn(f"{message}: category left out of the schedule", stacklevel=3)
        return shares

    def _make_schedule(self) -> CategorySchedule:
        counts = self.manifest.split(self.split).class_counts
        sizes: dict[int, int] = {}
        unlabelled = 0
        for cid, n in counts.items():
            category = self.manifest.classes[cid].category
            if category is None:
                unlabelled += n
            elif category in self.shares:
                sizes[category] = sizes.get(category, 0) + n
        return CategorySchedule(
            self.schedule_config,
            sizes,
            self.global_batch,
            unlabelled_size=unlabelled,
            total_size=sum(counts.values()),
        )

    # ---------------------------------------------------------------- position

    @property
    def steps_per_epoch(self) -> int:
        return self.schedule.steps_per_epoch

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self.steps_per_epoch

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, step) of the next batch to be handed out."""
        return self._position

    def state_dict(self) -> dict[str, int]:
        epoch, step = self._position
        return {"epoch": epoch, "step": step, "world_size": self.world_size, "num_workers": self.num_workers}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at (epoch, step). The layout must match: shares depend on world size and workers."""
        for key in ("world_size", "num_workers"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume a stream saved with {key}={state[key]} with {key}={getattr(self, key)}: each "
                    "slot's data share depends on it"
                )
        self.set_position(int(state["epoch"]), int(state["step"]))

    def set_position(self, epoch: int, step: int) -> None:
        if step >= self.steps_per_epoch:
            epoch, step = epoch + step // self.steps_per_epoch, step % self.steps_per_epoch
        self._position = (epoch, step)

    def set_epoch(self, epoch: int) -> None:
        self.set_position(epoch, 0)

    def advance(self, batch: Mapping[str, Any]) -> None:
        """Record that ``batch`` was consumed (the main process cannot see what worker copies did)."""
        self.set_position(int(batch["epoch"]), int(batch["step"]) + 1)

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, workers = (0, 0) if info is None else (info.id, info.num_workers)
        if workers != self.num_workers:
            raise RuntimeError(
                f"ShardStream was built for num_workers={self.num_workers} but runs under a DataLoader with "
                f"num_workers={workers}; pass the DataLoader's worker count to the stream"
            )
        return self.iter_worker(worker)

    def iter_worker(self, worker: int) -> Iterator[dict[str, Any]]:
        """The batches DataLoader worker ``worker`` yields from the current position to the end of the epoch.

        Public so tests (and tools) can play every (rank, worker) slot in one process.
        """
        epoch, start = self._position
        slot_worker = virtual_worker(worker, self.workers, start)
        slot = self.rank * self.workers + slot_worker
        cfg = self.schedule_config
        scans: dict[int, ShardScan] = {}
        packers = {
            group: Packer(
                class_stream(
                    shares[slot],
                    lambda i: self._scan(i, scans),
                    [cfg.seed, epoch, group + 2, slot],
                    window=self.class_window,
                ),
                share_images=share_size(self.shards, shares[slot]),
                lookahead=self.lookahead,
            )
            for group, shares in self.shares.items()
        }
        reader = MemberReader()
        transform = (train_transform if self.augment else test_transform)(self.transform_config)
        try:
            for step in range(slot_worker, self.steps_per_epoch, self.workers):
                groups = self.schedule.step(epoch, step)
                quotas = group_quotas(self.local_batch, len(groups), self.rank)
                refs = [r for g, q in zip(groups, quotas) for r in packers[g].take(q)]
                if step >= start:
                    yield self._batch(epoch, step, groups, refs, scans, reader, transform)
        finally:
            reader.close()

    def _scan(self, index: int, scans: dict[int, ShardScan]) -> ShardScan:
        if index not in scans:
            path = self.manifest.shard_path(self.shards[index])
            scan = scan_shard(path, expected=self.shards[index].samples)
            name = self.shards[index].path
            if scan.error is not None and name not in self.stats.bad_shards:
                warnings.warn(
                    f"shard {path}: {scan.error}; using its {len(scan.samples)} complete sample(s)",
                    stacklevel=2,
                )
                self.stats.bad_shards.append(name)
                self.stats.dropped_samples += max(0, self.shards[index].samples - len(scan.samples))
            scans[index] = scan
        return scans[index]

    def _batch(
        self,
        epoch: int,
        step: int,
        groups: tuple[int, ...],
        refs: list[Ref],
        scans: dict[int, ShardScan],
        reader: MemberReader,
        transform: Any,
    ) -> dict[str, Any]:
        entries = [scans[s].samples[j] for s, j in refs]
        paths = [self.manifest.shard_path(self.shards[s]) for s, _ in refs]
        labels = torch.tensor([e.class_id for e in entries], dtype=torch.int64)
        seed = int(
            np.random.SeedSequence([self.schedule_config.seed, epoch, step, self.rank]).generate_state(1)[0]
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            images = self._images(entries, paths, labels, reader, transform)
        return {
            "images": images,
            "labels": labels,
            "categories": torch.from_numpy(self._class_category[labels.numpy()]),
            "keys": [e.key for e in entries],
            "epoch": epoch,
            "step": step,
            "groups": groups,
            "stats": self.stats.as_dict(),
        }

    def _images(
        self,
        entries: list[SampleEntry],
        paths: list[Path],
        labels: torch.Tensor,
        reader: MemberReader,
        transform: Any,
    ) -> torch.Tensor:
        """Decode and transform; an undecodable image is replaced by a same-class one so the size stays exact."""
        draft = self.transform_config.resize
        out: list[torch.Tensor | None] = []
        for entry, path in zip(entries, paths):
            try:
                data = reader.read(path, entry.image_offset, entry.image_size)
                out.append(transform(decode_image(data, draft)))
            except (OSError, ValueError, SyntaxError, EOFError) as exc:
                warnings.warn(f"{path}: cannot decode {entry.key}.{entry.image_ext}: {exc}", stacklevel=2)
                self.stats.decode_errors += 1
                out.append(None)
        good = [i for i, x in enumerate(out) if x is not None]
        if not good:
            raise RuntimeError("no image of this batch could be decoded; run `ddp-rank shards verify`")
        for i, x in enumerate(out):
            if x is None:
                same = [j for j in good if labels[j] == labels[i]]
                out[i] = out[(same or good)[0]]
        return normalize_batch([x for x in out if x is not None], self.transform_config)
