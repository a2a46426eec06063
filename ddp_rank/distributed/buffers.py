"""Keeping per-rank state equal across ranks: averaged buffers and a differentiable all-reduce.

Data parallelism keeps the parameters equal (every rank applies the same averaged gradient) but not the
buffers a forward updates in place, such as BatchNorm's running statistics: each rank updates them with its own
local batch. ``average_tensors`` makes such buffers identical (the mean over ranks, in place, one all-reduce per
dtype). ``differentiable_all_reduce_sum`` is the collective a cross-rank statistic needs when gradients must flow
through it (every rank's input influences every rank's output, so the gradient is the all-reduced gradient).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ddp_rank.distributed.process_group import ProcessGroup, is_distributed, world_size


@torch.no_grad()
def average_tensors(tensors: Sequence[Tensor], group: ProcessGroup | None = None) -> None:
    """Replace every tensor by its mean over the ranks of ``group``, in place (a no-op in one process).

        Floating tensors are averaged; integer tensors (BatchNorm's ``num_batches_tracked``) take the maximum, which
        equals every rank's value when the ranks stepped together. Tensors are flattened into one buffer per dtype and
        device, so a ResNet-50's 106 BatchNorm buffers cost two all-reduces; bf16 / fp16 ones (a DeepSpeed bf16 run's) are
    summed in float32.
    """
    if not is_distributed(group) or not tensors:
        return
    w = world_size(group)
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, _), members in buckets.items():
        flat = torch.cat([t.reshape(-1) for t in members])
        if dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()  # the sum of W reduced-precision values would round at every addition
        if dtype.is_floating_point:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(w)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
        for t, part in zip(members, flat.split([m.numel() for m in members])):
            t.copy_(part.view_as(t))


class _AllReduceSum(torch.autograd.Function):
    """``y = sum over ranks of x`` on every rank; ``dL/dx = sum over ranks of dL/dy`` (every y depends on x)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def differentiable_all_reduce_sum(x: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """The sum of ``x`` over the ranks of ``group`` with a gradient (``x`` itself in one process)."""
    if not is_distributed(group):
        return x
    return _AllReduceSum.apply(x, group)
