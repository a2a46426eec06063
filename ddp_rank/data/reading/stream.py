"""The training stream: this rank's part of each step's global plan, read by class and decoded.

Per step ``s`` of epoch ``e``, every rank computes the global batch (``plan.GlobalPlan``, a pure function of
seed, epoch, step, manifest and sampler settings), deals it to the W ranks (``dealing.deal``) and reads only its
own part: one ranged read per class (``reader.ClassReader``), from a local directory or a URL. DataLoader
workers only split the decoding: worker w of a rank produces steps start + w, start + w + n_workers, ..., which a
DataLoader with ``batch_size=None`` hands out round-robin, i.e. in step order. Which images make up a step never
depends on the workers or on the world size, so a run on 1 GPU (chunked) and on 64 GPUs see the same global
batches, and ``load_state_dict({"epoch": e, "step": s})`` resumes the same sequence on any layout.

Augmentation is seeded per image from (seed, epoch, step, class, image), so even the crops and flips of an image
are the same whichever rank or worker decodes it.

Faults: a class this rank cannot read or decode (missing shard, HTTP error, truncated range, digest mismatch,
undecodable image) is replaced by a class of the same group with at least as many images from the step's
reserve (``GlobalPlan.reserve``: disjoint across ranks, never a class of the step), deterministically, and
counted. When no replacement is left, the batch raises ``DataError`` naming the shards; the trainer shares it
with every rank so that all of them stop with that message.

Each yielded batch is a ``batch.StreamBatch``: images, labels, categories, sample keys, epoch, step, the
schedule's groups and ``events`` (``batch.DataEvents``: this batch's replaced classes, decode errors and bad
shards, and the store's cache fallbacks and read retries).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import get_worker_info

from ddp_rank.data.features.records import decode_vector
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.format.tar_scan import SpanSample
from ddp_rank.data.reading.batch import DataEvents, StreamBatch
from ddp_rank.data.reading.decode import ImageDecodeError, decode_image
from ddp_rank.data.reading.reader import ClassReadError, group_failures
from ddp_rank.data.reading.shard_cache import ShardCache
from ddp_rank.data.reading.split_source import SplitSource
from ddp_rank.data.reading.transforms import (
    TransformConfig,
    collate_images,
    test_transform,
    train_transform,
)
from ddp_rank.data.sampling.dealing import deal
from ddp_rank.data.sampling.plan import Catalog, GlobalPlan, Piece, PlanError, local_batch_size
from ddp_rank.data.sampling.schedule import ScheduleConfig

log = logging.getLogger(__name__)

_MASK = (1 << 63) - 1


class DataError(RuntimeError):
    """The data layer cannot produce this rank's batch (every replacement failed too); names the shards."""


def image_seed(*parts: int) -> int:
    """A 63-bit seed from integers (a fast splitmix-style mix; ``SeedSequence`` costs 20 us per image)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK)) * 0xBF58476D1CE4E5B9 & ((1 << 64) - 1)
        h ^= h >> 31
    return h & _MASK


class ShardStream(SplitSource):
    """This rank's local batches, one per step, from a shard directory or URL.

    Args:
        shards: the shard directory or URL (or its loaded ``Manifest``).
        global_batch: M, images per step over ALL ranks; each rank yields ``global_batch / world_size``.
        split: the manifest split to stream.
        schedule: the sampler settings (``ScheduleConfig``: strategy, categories per batch, K, seed, ...).
        transform: image sizes (``TransformConfig``); ``augment`` picks the train (random) or test transform.
        num_workers: the DataLoader's worker count (how the steps are split for decoding; never what is drawn).
        rank, world_size: default to the process group, else RANK / WORLD_SIZE, else 0 / 1.
        cache_dir: node-local directory for whole shards fetched from a URL (``storage.ShardStore``), or a
            ``ShardCache`` (a directory with a cap).

    One ``iter`` yields the rest of the current epoch. ``StreamLoader`` wraps the DataLoader and moves the
    position on as it hands out batches; with a raw ``DataLoader(stream, batch_size=None, num_workers=...)``
    call ``advance(batch)`` (or ``set_epoch``) yourself, since worker copies cannot report back.

    Examples:
        The first step's batch of one process, from shards of a synthetic image folder of two categories of
        two classes of three images (the ``hard`` sampler that ``auto`` picks here draws whole classes of each
        category):

        >>> import tempfile
        >>> from pathlib import Path
        >>> from ddp_rank.data import BuildOptions, ShardStream, TransformConfig, build_shards, read_image_folder
        >>> from ddp_rank.data.building.synthetic import write_image_folder
        >>> root = Path(tempfile.mkdtemp())
        >>> _ = write_image_folder(root / "images", [[3, 3], [3, 3]])  # images per class, per category
        >>> _ = build_shards(read_image_folder(root / "images"), root / "shards", BuildOptions(progress=False))
        >>> stream = ShardStream(root / "shards", 6, rank=0, world_size=1, transform=TransformConfig(resize=8, crop=8))
        >>> batch = next(iter(stream))
        >>> tuple(batch.images.shape), batch.labels.tolist(), batch.categories.tolist()
        ((6, 3, 8, 8), [0, 0, 0, 2, 2, 2], [0, 0, 0, 1, 1, 1])
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
        cache_dir: str | os.PathLike[str] | ShardCache | None = None,
    ) -> None:
        super().__init__(shards, split, rank, world_size, cache_dir)
        self.global_batch = global_batch
        self.local_batch = local_batch_size(global_batch, self.world_size)
        self.num_workers = num_workers
        self.schedule_config = schedule or ScheduleConfig()
        self.transform_config = transform or TransformConfig()
        self.augment = augment
        self.plan = GlobalPlan(
            Catalog.from_manifest(self.manifest, split), self.schedule_config, global_batch
        )
        for left in self.plan.left_out if self.rank == 0 else ():  # every rank plans alike: say it once
            log.warning(f"category left out of the schedule: {left}")
        self._warned: set[tuple[str, str]] = set()  # (shard, reason) of the failures already logged
        self._position = (0, 0)

    # ---------------------------------------------------------------- position

    @property
    def steps_per_epoch(self) -> int:
        return self.plan.steps_per_epoch

    @property
    def left_out(self) -> list[str]:
        """Categories the schedule cannot use, with images needed vs available."""
        return [str(x) for x in self.plan.left_out]

    def __len__(self) -> int:
        """Batches per epoch on this rank (the same on every rank)."""
        return self.steps_per_epoch

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, step) of the next batch to be handed out."""
        return self._position

    def state_dict(self) -> dict[str, int]:
        epoch, step = self._position
        return {"epoch": epoch, "step": step}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at (epoch, step), on any world size and worker count: the plan depends on neither."""
        self.set_position(int(state["epoch"]), int(state["step"]))

    def set_position(self, epoch: int, step: int) -> None:
        if step >= self.steps_per_epoch:
            epoch, step = epoch + step // self.steps_per_epoch, step % self.steps_per_epoch
        self._position = (epoch, step)

    def set_epoch(self, epoch: int) -> None:
        self.set_position(epoch, 0)

    def advance(self, batch: StreamBatch) -> None:
        """Record that ``batch`` was consumed (the main process cannot see what worker copies did)."""
        self.set_position(batch.epoch, batch.step + 1)

    # ---------------------------------------------------------------- iteration

    def __iter__(self) -> Iterator[StreamBatch]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return self.iter_worker(worker, workers)

    def iter_worker(self, worker: int, num_workers: int) -> Iterator[StreamBatch]:
        """The batches DataLoader worker ``worker`` of ``num_workers`` yields from the current position to the
        end of the epoch. Public so tests (and tools) can play every worker in one process."""
        epoch, start = self._position
        try:
            for step in range(start + worker, self.steps_per_epoch, max(1, num_workers)):
                yield self.batch(epoch, step)
        finally:
            self.reader.close()

    def part(self, epoch: int, step: int) -> list[Piece]:
        """This rank's pieces of (epoch, step)."""
        return deal(self.plan.step(epoch, step), self.world_size, self.schedule_config.seed)[self.rank]

    def batch(self, epoch: int, step: int) -> StreamBatch:
        """Read, decode and transform this rank's part of (epoch, step)."""
        pieces = self.part(epoch, step)
        events = DataEvents()
        taken: set[int] = set()  # replacement classes already used in this batch
        transform = (train_transform if self.augment else test_transform)(self.transform_config)
        images: list[torch.Tensor] = []
        labels: list[int] = []
        keys: list[str] = []
        for piece in pieces:
            class_id, chosen, tensors = self._load_with_replacement(
                epoch, step, piece, transform, events, taken
            )
            images.extend(tensors)
            labels.extend([class_id] * len(tensors))
            keys.extend(chosen)
        events.add_counts(self.reader.store.take_counts())  # cache_fallbacks, read_retries
        label_tensor = torch.tensor(labels, dtype=torch.int64)
        return StreamBatch(
            images=torch.stack(images) if self.feature_dim else collate_images(images, self.transform_config),
            labels=label_tensor,
            categories=torch.from_numpy(self._class_category[label_tensor.numpy()]),
            keys=keys,
            epoch=epoch,
            step=step,
            groups=self.plan.step(epoch, step).groups,
            events=events,
        )

    def _load_with_replacement(
        self, epoch: int, step: int, piece: Piece, transform: Any, events: DataEvents, taken: set[int]
    ) -> tuple[int, list[str], list[torch.Tensor]]:
        """The piece's images, or those of a replacement class from this rank's reserve (see the module
        docstring); ``taken`` holds the replacements this batch already used, so none is used twice."""
        failures: list[ClassReadError] = []
        candidates: Sequence[int] | None = None
        drawn = piece  # the piece, then each replacement tried in its place
        while True:
            try:
                keys, tensors = self._load(epoch, step, drawn, transform, events)
                if failures:
                    events.replaced_classes += len(failures)
                return drawn.class_id, keys, tensors
            except ClassReadError as exc:
                failures.append(exc)
                events.note_bad_shard(exc.shard)
                self._warn_once(exc)
            if candidates is None:
                reserve = self.plan.reserve(epoch, step, piece.group, self.rank, self.world_size)
                candidates = [c for c in reserve if self.plan.class_size(c) >= piece.size]
            candidates = [c for c in candidates if c not in taken]
            if not candidates:
                shards = sorted({f.shard for f in failures})
                raise DataError(
                    f"cannot fill this rank's part of epoch {epoch} step {step}: {group_failures(failures)}; "
                    f"no readable replacement of >= {piece.size} images is left. Check the shards "
                    f"({', '.join(shards)}) with `ddp-rank shards verify`"
                )
            class_id, candidates = candidates[0], candidates[1:]
            taken.add(class_id)
            n = self.plan.class_size(class_id)
            order = np.random.default_rng(
                image_seed(self.schedule_config.seed, epoch, step, class_id)
            ).permutation(n)
            drawn = Piece(class_id, order[: piece.size].tolist(), piece.group)

    def _warn_once(self, failure: ClassReadError) -> None:
        """A class replaced: its failure's cause (shard and reason) in full the first time this stream meets it,
        then nothing more for that cause (a truncated shard fails each of its classes alike; the replacements
        are counted in the run's data events)."""
        cause = (failure.shard, failure.reason)
        if cause in self._warned:
            return
        self._warned.add(cause)
        log.warning(
            f"{failure}; replaced from the plan's reserve (further classes failing for this same cause are "
            "replaced without a line each, and counted)"
        )

    def _load(
        self, epoch: int, step: int, piece: Piece, transform: Any, events: DataEvents
    ) -> tuple[list[str], list[torch.Tensor]]:
        """(keys, tensors) of ``piece``'s images, each decoded and transformed with its own seed; raises
        ``ClassReadError`` where the class cannot be read or an image does not decode."""
        class_id = piece.class_id
        samples = self.reader.read(class_id)
        if self.feature_dim is not None:
            return self._load_vectors(class_id, samples, piece.images, events)
        keys, out = [], []
        for index in piece.images:
            sample: SpanSample = samples[index]
            try:
                decoded = decode_image(
                    sample.image,
                    self.transform_config.resize,
                    name=f"{sample.key}.{sample.image_ext}",
                    max_pixels=self.transform_config.max_pixels,
                )
            except ImageDecodeError as exc:
                events.decode_errors += 1
                shard = self.reader.shard_of(class_id, index)
                raise ClassReadError(class_id, shard, str(exc)) from exc
            # Each image's augmentation draws from a generator of its own, seeded by where the image stands in
            # the plan: never the torch RNG the model draws from, so batches may be read in another thread
            # (the trainer's feed) without moving or racing the model's random stream.
            generator = torch.Generator().manual_seed(
                image_seed(self.schedule_config.seed, epoch, step, class_id, index)
            )
            out.append(transform(decoded, generator))
            keys.append(sample.key)
        return keys, out

    def _load_vectors(
        self, class_id: int, samples: Sequence[SpanSample], images: Sequence[int], events: DataEvents
    ) -> tuple[list[str], list[torch.Tensor]]:
        """The vectors of samples ``images`` of a feature class: no transform, so no per-image seed either."""
        dim = self.feature_dim or 0
        keys, out = [], []
        for index in images:
            sample = samples[index]
            keys.append(sample.key)
            try:
                out.append(torch.from_numpy(decode_vector(sample.image, dim)))
            except ValueError as exc:
                events.decode_errors += 1
                shard = self.reader.shard_of(class_id, index)
                raise ClassReadError(class_id, shard, f"vector {sample.key} does not decode: {exc}") from exc
        return keys, out


__all__ = ["DataError", "PlanError", "ShardStream", "image_seed"]
