"""Embedding a test set on all ranks and gathering it (padded) on every rank.

Each rank embeds its own share of the test shards (the data layer splits them by rank); the shares are uneven
in general, so the rows are gathered with the distributed layer's padded all-gather (sizes first, pad to the
largest, gather, unpad). Every sample carries a global index derived from its key; rows are sorted by it after
the gather, so the result, and the random VehicleID gallery draw made from it, do not depend on the world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ddp_rank.distributed.collectives import all_gather_ints, padded_all_gather
from ddp_rank.distributed.process_group import is_distributed
from ddp_rank.eval.protocols import EmbeddedSet

__all__ = ["EvalBatch", "embed_batches", "gather_embedded"]


@dataclass
class EvalBatch:
    """One batch of test images: ``images [n, 3, H, W]`` in [0, 1] or uint8, ``labels [n]``, ``subset_bits [n]``,
    ``index [n]`` (a global index of each sample, derived from its key: the same whatever the world size)."""

    images: Tensor
    labels: Tensor
    subset_bits: Tensor
    index: Tensor
    keys: Sequence[str] = ()
    """Each sample's key, where the reader knows it (``ddp_rank.eval.runner.embed_split`` keeps them when asked)."""


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager[object]:
    """Autocast to ``dtype`` on ``device`` for the forward passes of embedding (a no-op for ``None``)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def embed_batches(
    model: nn.Module,
    batches: Iterable[EvalBatch],
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Embed this rank's batches in eval mode: returns (embeddings float32, labels, subset_bits, index) on CPU.

    The model's train/eval mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    device = torch.device(device)
    embs, labels, bits, index = [], [], [], []
    try:
        for b in batches:
            with autocast(device, autocast_dtype):
                e = model(b.images.to(device, non_blocking=True))
            embs.append(e.float().cpu())
            labels.append(b.labels.long().cpu())
            bits.append(b.subset_bits.long().cpu())
            index.append(b.index.long().cpu())
    finally:
        model.train(was_training)
    if not embs:
        # A rank with no test sample still takes part in the gather; it learns the width there.
        return (
            torch.empty(0, 0),
            torch.empty(0, dtype=torch.long),
            torch.empty(0, dtype=torch.long),
            torch.empty(0, dtype=torch.long),
        )
    return torch.cat(embs), torch.cat(labels), torch.cat(bits), torch.cat(index)


def gather_embedded(
    embeddings: Tensor, labels: Tensor, subset_bits: Tensor, index: Tensor, device: torch.device | str = "cpu"
) -> EmbeddedSet:
    """Padded all-gather of every rank's rows onto every rank, sorted by the global sample index.

    ``device`` is where the collective runs (NCCL needs CUDA tensors; gloo takes CPU ones).
    """
    if is_distributed():
        meta = all_gather_ints([embeddings.shape[0], embeddings.shape[1] if embeddings.ndim == 2 else 0])
        sizes = meta[:, 0].tolist()
        dims = {int(d) for n, d in meta.tolist() if n > 0}
        if len(dims) > 1:
            raise RuntimeError(f"ranks produced embeddings of different widths {sorted(dims)}")
        if embeddings.shape[0] == 0:  # this rank embedded nothing: give its empty block the common width
            embeddings = embeddings.new_empty(0, dims.pop() if dims else 0)
        dev = torch.device(device)
        embeddings = padded_all_gather(embeddings.to(dev), sizes).cpu()
        packed = torch.stack([labels, subset_bits, index], dim=1).to(dev)
        packed = padded_all_gather(packed, sizes).cpu()
        labels, subset_bits, index = packed.unbind(1)
    order = torch.argsort(index)
    if len(index) and torch.unique(index).numel() != len(index):
        raise RuntimeError("the test split was read twice by the ranks (duplicate sample indices)")
    return EmbeddedSet(embeddings[order], labels[order], subset_bits[order], index[order])
