"""Collectives for uneven per-rank row blocks, with an optional count of the bytes they move.

gloo (and NCCL's `*_single` collectives) need the same tensor size on every rank, but the ranks of a
training step may hold different numbers of rows (uneven shards, a last partial batch, a rank with no
sample at all). Each helper therefore pads every rank's block to the largest block, runs one fixed-size
collective and strips the padding. Padding rows are zeros, so they change no sum.

Bytes are counted with the ring-algorithm convention used by nccl-tests' "bus bandwidth": the bytes one rank
sends for a collective over `W` ranks are `(W - 1) / W * B` for an all-gather whose output is `B` bytes or a
reduce-scatter whose input is `B` bytes, and `2 (W - 1) / W * B` for an all-reduce of `B` bytes. Padding is
counted: it is sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_rank.distributed.process_group import ProcessGroup, collective_device, rank, world_size

# torch 2.14 renamed the fixed-size collectives; older releases (>= 2.3, our floor) only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommCounter:
    """Bytes this rank sent through the helpers below, per collective kind (ring convention, see module doc)."""

    bytes_sent: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: float) -> None:
        """Record `nbytes` sent by one call of collective `kind`."""
        self.bytes_sent[kind] = self.bytes_sent.get(kind, 0) + round(nbytes)

    @property
    def total(self) -> int:
        """All bytes sent, every kind together."""
        return sum(self.bytes_sent.values())

    def reset(self) -> None:
        """Forget everything counted so far."""
        self.bytes_sent.clear()


def _count(counter: CommCounter | None, kind: str, nbytes: int, world: int, factor: float = 1.0) -> None:
    if counter is not None:
        counter.add(kind, factor * (world - 1) / world * nbytes)


def all_gather_ints(
    values: Sequence[int], group: ProcessGroup | None = None, counter: CommCounter | None = None
) -> Tensor:
    """Gather a short vector of Python ints from every rank: returns int64 [W, len(values)] on CPU.

    Used to exchange row counts and shape/dtype metadata before the real collectives, so that every rank can
    size its buffers and every rank can detect (and report) a mismatch instead of hanging in a collective.
    """
    world = world_size(group)
    local = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    out = local.new_empty(world * local.numel())
    _all_gather_single(out, local, group=group)
    _count(counter, "all_gather_meta", out.numel() * out.element_size(), world)
    return out.view(world, local.numel()).cpu()


def padded_all_gather(
    local: Tensor, sizes: Sequence[int], group: ProcessGroup | None = None, counter: CommCounter | None = None
) -> Tensor:
    """All-gather row blocks of uneven length: returns `cat([block_0, ..., block_{W-1}])`, [sum(sizes), ...].

    `sizes[r]` is the number of rows of rank r (from `all_gather_ints`); `local` is this rank's block with
    `sizes[rank]` rows. No autograd: callers that need a gradient route it themselves (see
    `GlobalBatchLossFunction`), because the gradient of a gather is a reduce-scatter they want to control.
    """
    world, me = world_size(group), rank(group)
    if local.shape[0] != sizes[me]:
        raise ValueError(f"rank {me}: local block has {local.shape[0]} rows but sizes[{me}] = {sizes[me]}")
    width = max(sizes)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: local.shape[0]] = local
    gathered = local.new_empty((world * width, *local.shape[1:]))
    _all_gather_single(gathered, padded.contiguous(), group=group)
    _count(counter, "all_gather", gathered.numel() * gathered.element_size(), world)
    blocks = gathered.view(world, width, *local.shape[1:])
    return torch.cat([blocks[r, : sizes[r]] for r in range(world)])


def padded_reduce_scatter(
    rows: Tensor, sizes: Sequence[int], group: ProcessGroup | None = None, counter: CommCounter | None = None
) -> Tensor:
    """Sum `rows` [sum(sizes), ...] over ranks and return this rank's block, [sizes[rank], ...].

    This is the adjoint of `padded_all_gather`: rank r receives the SUM over all ranks of the rows that
    belong to r.
    """
    world, me = world_size(group), rank(group)
    if rows.shape[0] != sum(sizes):
        raise ValueError(f"rank {me}: {rows.shape[0]} rows to reduce-scatter but sum(sizes) = {sum(sizes)}")
    width = max(sizes)
    padded = rows.new_zeros((world, width, *rows.shape[1:]))
    for r, block in enumerate(torch.split(rows, list(sizes))):
        padded[r, : sizes[r]] = block
    out = rows.new_empty((width, *rows.shape[1:]))
    _reduce_scatter_single(
        out, padded.view(world * width, *rows.shape[1:]), op=dist.ReduceOp.SUM, group=group
    )
    _count(counter, "reduce_scatter", padded.numel() * padded.element_size(), world)
    return out[: sizes[me]]


def all_reduce_sum(
    tensor: Tensor, group: ProcessGroup | None = None, counter: CommCounter | None = None
) -> Tensor:
    """Return the sum of `tensor` over ranks (a new tensor; the input is left untouched)."""
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    _count(counter, "all_reduce", out.numel() * out.element_size(), world_size(group), factor=2.0)
    return out
