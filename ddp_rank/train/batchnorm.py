"""BatchNorm across ranks: statistics of the global batch (``model.sync_bn``) and identical running buffers.

Two separate problems, two tools:

- **Normalisation statistics.** In train mode a BatchNorm layer normalises with the statistics of the batch it
  sees, on one rank its local share. ``model.sync_bn`` converts every layer to :class:`CrossRankBatchNorm`, which
  normalises with the mean and variance of the GLOBAL batch: a 2-rank step then computes what one process computes
  on the concatenated batch (tested), at the price of two small all-reduces per layer and forward. On CUDA the
  layers become PyTorch's own ``SyncBatchNorm`` (fused kernels); on CPU processes (gloo), which ``SyncBatchNorm``
  and DDP refuse, the same maths runs through a differentiable all-reduce.
- **Running buffers.** Whatever the setting, the running mean and variance drift apart across ranks: each rank
  folds its own batch into them (DDP only broadcasts rank 0's before each forward; DeepSpeed never). The rule
  used here: before every step (direct, or the first pass of a chunked one), every evaluation and every
  checkpoint, each buffer is replaced by its MEAN over the ranks (``sync_batchnorm_buffers``). Averaging before
  every step, not only at checkpoints, is what keeps a checkpoint from changing the run: the average it takes is
  the one the next step takes anyway (the mean of equal values is exact), so a run stopped and resumed at any step
  has the buffers of an uninterrupted one (the soak test caught a stop between checkpoints changing them). The mean of the ranks' exponential averages
  is the exponential average of the global batch's means (for equal local batches), so it loses none of the
  ranks' data, unlike keeping rank 0's; the counter ``num_batches_tracked`` is equal on every rank anyway.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddp_rank.distributed.buffers import average_tensors, differentiable_all_reduce_sum
from ddp_rank.distributed.process_group import ProcessGroup, is_distributed

__all__ = [
    "CrossRankBatchNorm",
    "batchnorm_buffers",
    "convert_to_cross_rank",
    "match_batchnorm_buffers_to_weights",
    "sync_batchnorm_buffers",
    "take_over_batchnorm",
]


class CrossRankBatchNorm(_BatchNorm):
    """BatchNorm whose train-mode statistics are those of the global batch, on any device (CPU ranks included).

    Gradients follow ``SyncBatchNorm``'s convention (each rank's upstream gradients are summed over ranks where a
    global statistic is involved), so under DDP's gradient averaging the update is that of one process on the
    concatenated batch. Eval mode and one process are plain BatchNorm. It is a plain ``_BatchNorm`` subclass, not a
    ``SyncBatchNorm``, because DDP refuses ``SyncBatchNorm`` layers in a CPU module.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: ProcessGroup | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        group = self.process_group
        if not (self.training and is_distributed(group)):
            return super().forward(input)
        self._check_input_dim(input)
        channels = input.shape[1]
        rows = input.transpose(0, 1).reshape(channels, -1)
        count = torch.tensor([float(rows.shape[1])], dtype=torch.float64)
        dist.all_reduce(count, group=group)
        n = float(count.item())
        if n < 2:
            raise ValueError(
                f"BatchNorm in train mode needs at least 2 values per channel over all ranks, got {int(n)}"
            )
        mean = differentiable_all_reduce_sum(rows.sum(dim=1), group) / n
        centred = rows - mean[:, None]
        var = differentiable_all_reduce_sum(centred.pow(2).sum(dim=1), group) / n
        out = centred * torch.rsqrt(var + self.eps)[:, None]
        if self.affine:
            out = out * self.weight[:, None] + self.bias[:, None]
        self._update_running(mean.detach(), var.detach(), n)
        return out.reshape(channels, input.shape[0], *input.shape[2:]).transpose(0, 1)

    @torch.no_grad()
    def _update_running(self, mean: Tensor, var: Tensor, n: float) -> None:
        """The running statistics as ``F.batch_norm`` updates them (variance unbiased, momentum or cumulative)."""
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        unbiased = var * (n / (n - 1))
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def take_over_batchnorm(replacement: _BatchNorm, layer: _BatchNorm) -> _BatchNorm:
    """``replacement`` made to share ``layer``'s parameters and running statistics (the same tensors, so the
    optimizer and checkpoints see no change) and its train/eval mode; returns ``replacement``."""
    if layer.affine:
        replacement.weight, replacement.bias = layer.weight, layer.bias
    if layer.track_running_stats:
        replacement.running_mean = layer.running_mean
        replacement.running_var = layer.running_var
        replacement.num_batches_tracked = layer.num_batches_tracked
    replacement.train(layer.training)
    return replacement


def convert_to_cross_rank(
    module: nn.Module, group: ProcessGroup | None = None, *, cuda: bool = False
) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by one with global-batch statistics and the same parameters
    and buffers: ``nn.SyncBatchNorm`` for a model that will run on CUDA (``cuda``), :class:`CrossRankBatchNorm`
    otherwise. Returns the new module when ``module`` itself is a BatchNorm layer; else converts in place."""
    if cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, group)
    if isinstance(module, _BatchNorm) and not isinstance(module, (nn.SyncBatchNorm, CrossRankBatchNorm)):
        converted = CrossRankBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            group,
        )
        return take_over_batchnorm(converted, module)
    for name, child in module.named_children():
        module.add_module(name, convert_to_cross_rank(child, group, cuda=cuda))
    return module


def match_batchnorm_buffers_to_weights(module: nn.Module) -> int:
    """Give every BatchNorm layer's running mean and variance its weight's dtype; returns how many layers changed.

    Why: DeepSpeed's bf16 / fp16 mode (0.19 on) casts the parameters and keeps the buffers in their loaded dtype,
    and torch's batch_norm (CPU and CUDA, train and eval mode) refuses a bf16 weight beside float32 running
    statistics: "expected scalar type BFloat16 but found Float" at the first forward. Earlier DeepSpeed releases
    cast the whole module, buffers included; this restores that for the BatchNorm layers alone. The batch counter
    stays an integer. Called after ``deepspeed.initialize`` (ZeRO-1/2 own the parameters, not the buffers).
    """
    changed = 0
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if not isinstance(m, _BatchNorm) or weight is None or not m.track_running_stats:
            continue
        stats = [b for b in (m.running_mean, m.running_var) if b is not None and b.dtype != weight.dtype]
        for buffer in stats:
            buffer.data = buffer.data.to(weight.dtype)
        changed += bool(stats)
    return changed


def batchnorm_buffers(module: nn.Module) -> list[Tensor]:
    """The running statistics of every BatchNorm layer of ``module`` (mean, variance, batch counter)."""
    buffers: list[Tensor] = []
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.track_running_stats:
            buffers += [b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None]
    return buffers


def sync_batchnorm_buffers(module: nn.Module, group: ProcessGroup | None = None) -> None:
    """Collective: every rank's BatchNorm running statistics become their mean over the ranks (see the module
    doc). Every rank must call it at the same point; a model without BatchNorm makes it a no-op (no collective)."""
    average_tensors(batchnorm_buffers(module), group)
