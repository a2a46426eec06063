"""Evaluate a model on a test split of a shard directory: read (by rank), embed, gather, search, score.

Used by the trainer (periodic evaluation) and by ``ddp-rank eval``. Every rank reads and embeds its contiguous
part of the split (``ddp_rank.data.reading.eval_reader.EvalShards``); the embeddings are gathered (padded) onto every
rank; rank 0 runs the exact search and the protocol and broadcasts the numbers, so all ranks return the same
dict (the trainer's best-checkpoint decision must be the same on every rank).

The images reach the model as uint8 pixels: the model scales them on its device and applies its backbone's own input
normalisation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader

from ddp_rank.config import DataConfig, EvalConfig
from ddp_rank.data.format.manifest import Manifest
from ddp_rank.data.reading.eval_reader import EvalShards
from ddp_rank.data.reading.loader import ignore_stop_signals
from ddp_rank.data.reading.shard_cache import open_cache
from ddp_rank.data.reading.transforms import transform_from_config
from ddp_rank.distributed.process_group import is_distributed, rank, world_size
from ddp_rank.eval.bootstrap import QueryBootstrap
from ddp_rank.eval.deployment import DeploymentSettings
from ddp_rank.eval.embed import EvalBatch, embed_batches, gather_embedded
from ddp_rank.eval.per_query import per_query_refusal
from ddp_rank.eval.protocols import (
    SUBSET_TOKENS,
    VEHICLEID_SIZES,
    EmbeddedSet,
    EvalError,
    evaluate,
    subsets_to_bits,
    with_largest_list_as_headline,
)

__all__ = [
    "EvalSettings",
    "evaluate_model",
    "key_index",
    "read_eval_batches",
    "score",
    "vehicleid_splits",
]


@dataclass(frozen=True)
class EvalSettings:
    """What an evaluation reads of a run: the config's ``eval`` and ``data`` sections as they are (``data.shards``,
    ``data.test_split``, the reader's workers and cache, the image sizes), and ``seed``: ``train.seed``
    (VehicleID's gallery draws, the identification split). Made once at start-up (``ddp_rank.eval.settings``)."""

    eval: EvalConfig
    data: DataConfig
    seed: int = 0

    @property
    def deployment(self) -> DeploymentSettings:
        """The options of the verification and identification metrics (``eval.fprs``, ``fpirs``,
        ``enrolled_fraction``, ``gallery_per_identity``, ``max_positive_pairs``, ``block_mb``; the split seeded
        with ``seed``)."""
        e = self.eval
        return DeploymentSettings(
            fprs=tuple(e.fprs),
            fpirs=tuple(e.fpirs),
            enrolled_fraction=e.enrolled_fraction,
            gallery_per_identity=e.gallery_per_identity,
            max_positive_pairs=e.max_positive_pairs,
            block_bytes=e.block_mb << 20,
            seed=self.seed,
        )


EmbeddedHook = Callable[[str, EmbeddedSet], None]
"""Called with each split's gathered embeddings (on every rank) before they are scored: the retrieval picture
(``ddp_rank.eval.retrieval_record``) is drawn from them."""


def key_index(key: str) -> int:
    """A stable 63-bit integer for a sample key (unique within a split): the sort key of gathered rows.

    Why a hash: the reader's workers interleave their batches, so a running position would depend on the worker
    count; the key does not, and sorting by its hash gives the same row order for any world size.
    """
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big") >> 1


def read_eval_batches(
    settings: EvalSettings,
    split: str,
    num_workers: int | None = None,
    rank_: int | None = None,
    world: int | None = None,
    manifest: Manifest | None = None,
) -> Iterator[EvalBatch]:
    """This rank's batches of ``split`` as :class:`EvalBatch` (uint8 images: the models convert them).
    ``manifest``: the already loaded manifest of ``data.shards`` (read from there when None)."""
    data = settings.data
    reader = EvalShards(
        manifest if manifest is not None else data.shards,
        split=split,
        batch_size=settings.eval.batch_size,
        transform=transform_from_config(data, pixels="uint8"),  # the model scales them on its device
        rank=rank() if rank_ is None else rank_,
        world_size=world_size() if world is None else world,
        cache_dir=open_cache(data.cache_dir, data.cache_max_gb),
    )
    workers = data.num_workers if num_workers is None else num_workers
    # The workers ignore the job's stop signals: a signal during the trainer's evaluation stops the run after the
    # next step, with a checkpoint, rather than killing a worker (ddp_rank.data.reading.loader.ignore_stop_signals).
    loader = DataLoader(reader, batch_size=None, num_workers=workers, worker_init_fn=ignore_stop_signals)
    for b in loader:
        yield EvalBatch(
            images=b.images,
            labels=b.labels,
            subset_bits=torch.tensor([subsets_to_bits(s) for s in b.subsets], dtype=torch.int64),
            index=torch.tensor([key_index(k) for k in b.keys], dtype=torch.int64),
            keys=tuple(b.keys),
        )


def embed_split(
    model: nn.Module,
    settings: EvalSettings,
    split: str,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    num_workers: int | None = None,
    manifest: Manifest | None = None,
    keys: bool = False,
) -> EmbeddedSet:
    """Embed ``split`` on all ranks and gather it onto every rank (rows sorted by sample key hash). ``keys``:
    with every sample's key too (``EmbeddedSet.keys``), gathered from all ranks."""
    batches = read_eval_batches(settings, split, num_workers, manifest=manifest)
    seen: dict[int, str] = {}
    if keys:
        batches = _noting_keys(batches, seen)
    e, y, bits, idx = embed_batches(model, batches, device=device, autocast_dtype=autocast_dtype)
    data = gather_embedded(e, y, bits, idx, device=device)
    if keys:
        data.keys = _gathered_keys(seen, data.index)
    return data


def _noting_keys(batches: Iterator[EvalBatch], seen: dict[int, str]) -> Iterator[EvalBatch]:
    """The batches unchanged, each one's ``{index: key}`` noted in ``seen`` as it passes."""
    for b in batches:
        seen.update(zip(b.index.tolist(), b.keys, strict=True))
        yield b


def _gathered_keys(seen: dict[int, str], index: Tensor | None) -> np.ndarray:
    """The keys of the gathered rows, in their order (``index``): every rank's ``{index: key}`` put together.

    Why by index and not by position: the rows were sorted by the key hash after the gather, and each rank's keys
    only travel as objects; matching them by hash is independent of how the ranks shared the split."""
    if is_distributed():
        every: list[dict[int, str]] = [{} for _ in range(world_size())]
        dist.all_gather_object(every, seen)
        seen = {i: key for part in every for i, key in part.items()}
    assert index is not None  # gather_embedded always sets it
    return np.asarray([seen[i] for i in index.tolist()], dtype=np.str_)


def evaluate_model(
    model: nn.Module,
    settings: EvalSettings,
    split: str | None = None,
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
    num_workers: int | None = None,
    manifest: Manifest | None = None,
    bootstrap: QueryBootstrap | None = None,
    on_embedded: EmbeddedHook | None = None,
    per_query: bool = False,
) -> dict[str, Any]:
    """Recall@k / MAP@R of ``model`` on ``split`` (default ``data.test_split``) with ``eval.protocol``;
    ``bootstrap``: with their spread over the queries (``ddp_rank.eval.bootstrap``); ``on_embedded``: given
    each embedded split (VehicleID recipe shards: each list's) before it is scored; ``per_query``: with each
    query's values under ``per_query`` (:class:`ddp_rank.eval.per_query.PerQuery`, rank 0 only; sop, inshop).

    Must be called on every rank; returns the same dict on every rank (but ``per_query``). ``manifest``: the
    loaded manifest of ``data.shards`` (the trainer passes its own, so a periodic evaluation reads no manifest);
    loaded once here when None.
    """
    refusal = per_query_refusal(settings.eval.protocol) if per_query else None
    if refusal is not None:
        raise EvalError(refusal)
    manifest = manifest if manifest is not None else Manifest.load(settings.data.shards)
    if settings.eval.protocol == "vehicleid":
        per_size = vehicleid_splits(settings, manifest) if split is None else _vehicleid_list_split(split)
        if per_size:
            return _evaluate_vehicleid_splits(
                model, settings, per_size, device, autocast_dtype, num_workers, manifest, on_embedded
            )
    target = split or settings.data.test_split
    data = embed_split(model, settings, target, device, autocast_dtype, num_workers, manifest, keys=per_query)
    if on_embedded is not None:
        on_embedded(target, data)
    return score(data, settings, device=device, bootstrap=bootstrap, per_query=per_query)


def _vehicleid_list_split(split: str) -> dict[str, str]:
    """``{"large": "test_large"}`` for one of the VehicleID recipe's list splits, else empty."""
    size = split.removeprefix("test_")
    return {size: split} if split.startswith("test_") and size in VEHICLEID_SIZES else {}


def vehicleid_splits(settings: EvalSettings, manifest: Manifest | None = None) -> dict[str, str]:
    """``{size: split}`` for the VehicleID test lists stored as splits ``test_small`` / ``test_medium`` /
    ``test_large`` (the data layer's VehicleID recipe); empty when the shards carry subset tokens instead."""
    splits = (manifest if manifest is not None else Manifest.load(settings.data.shards)).splits
    found: dict[str, str] = {s: f"test_{s}" for s in settings.eval.vehicleid_sizes if f"test_{s}" in splits}
    missing = [s for s in settings.eval.vehicleid_sizes if s not in found]
    if found and missing:
        raise EvalError(
            f"the shards have VehicleID splits {sorted(found.values())} but not test_{missing[0]}: rebuild them or "
            f"set eval.vehicleid_sizes={','.join(found)}"
        )
    return found


def _evaluate_vehicleid_splits(
    model: nn.Module,
    settings: EvalSettings,
    per_size: dict[str, str],
    device: torch.device | str,
    autocast_dtype: torch.dtype | None,
    num_workers: int | None,
    manifest: Manifest,
    on_embedded: EmbeddedHook | None = None,
) -> dict[str, Any]:
    """VehicleID with one split per test list: embed each list, mark it with its size, run the protocol."""
    out: dict[str, Any] = {}
    for size, split in per_size.items():
        data = embed_split(model, settings, split, device, autocast_dtype, num_workers, manifest)
        if on_embedded is not None:
            on_embedded(split, data)
        data.subset_bits = data.subset_bits | (1 << SUBSET_TOKENS.index(size))
        result = score(data, settings, vehicleid_sizes=[size], device=device)
        out.update({k: v for k, v in result.items() if k.startswith(f"{size}/")})
    return with_largest_list_as_headline(out, list(per_size))


def score(
    data: EmbeddedSet,
    settings: EvalSettings,
    vehicleid_sizes: list[str] | None = None,
    device: torch.device | str | None = None,
    bootstrap: QueryBootstrap | None = None,
    per_query: bool = False,
) -> dict[str, Any]:
    """Run ``eval.protocol`` on gathered embeddings on rank 0 and broadcast the result to every rank.

    The exact search runs where the model ran (``device``): chunked top-k on a GPU, faiss or top-k on a CPU.
    ``per_query``: rank 0's result keeps each query's values under ``per_query``; they are not broadcast (only
    rank 0 writes them, and SOP's 60k queries with their keys are megabytes the other ranks would not use).
    """
    result: list[Any] = [None]
    e = settings.eval
    if rank() == 0:
        try:
            result[0] = evaluate(
                e.protocol,
                data,
                list(e.ks) or None,
                map_at_r=e.map_at_r,
                backend=e.search,
                vehicleid_sizes=vehicleid_sizes or list(e.vehicleid_sizes),
                repeats=e.vehicleid_repeats,
                seed=settings.seed,
                device=device,
                metrics=list(e.metrics),
                deployment=settings.deployment,
                bootstrap=bootstrap,
                per_query=per_query,
            )
        except Exception as exc:  # report on every rank instead of leaving the others waiting
            result[0] = exc
    kept = result[0].pop("per_query", None) if isinstance(result[0], dict) else None
    if is_distributed():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise result[0]
    out = dict(result[0])
    if kept is not None:
        out["per_query"] = kept
    return out
