"""Ghost batch normalisation: BatchNorm statistics over fixed groups of images (``model.bn_group_size``).

Why: in train mode a BatchNorm layer normalises with the statistics of the rows it is given, so a chunked step
(``ddp_rank.train.chunking.step``) that embeds a local batch in chunks would normalise each chunk by itself, and the
function trained would depend on the chunk, which ``distributed.chunk_size=auto`` picks from the memory of the
machine. Here the statistics are taken over groups of ``group_size`` consecutive rows (Hoffer, Hubara and Soudry,
NeurIPS 2017, "ghost batch normalisation"). Groups are counted from the first row of whatever the layer is given,
so a forward of the whole local batch and forwards of chunks that are multiples of ``group_size`` form the SAME
groups: the direct and the chunked step compute one function.

Running statistics are updated once per group, in order, exactly as a plain BatchNorm layer that saw the groups
one after another (momentum, or the cumulative average with ``momentum=None``); the chunked step's first pass
meets the groups in the same order, and its second pass keeps the statistics of the first. A last group shorter
than ``group_size`` (a rank with fewer rows, in a user's own loop) is normalised by itself. Eval mode is plain
BatchNorm with the running statistics; a layer that tracks none normalises by groups in eval mode too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ddp_rank.train.batchnorm import take_over_batchnorm

__all__ = ["GhostBatchNorm", "convert_to_ghost"]


class GhostBatchNorm(_BatchNorm):
    """BatchNorm whose train-mode statistics are those of each group of ``group_size`` consecutive rows.

    Shapes: ``x [n, C, ...]`` -> same; rows ``g*G .. (g+1)*G - 1`` are normalised with their own mean and
    (biased) variance over the rows and every spatial position, as ``F.batch_norm`` does for a batch of ``G``.
    Parameters and buffers are those of ``nn.BatchNorm*d``, so checkpoints load into a plain model.
    """

    def __init__(
        self,
        num_features: int,
        group_size: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"GhostBatchNorm needs a group_size of at least 1 row, got {group_size}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.group_size = group_size

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        batch_statistics = self.training or self.running_mean is None
        if not batch_statistics or input.shape[0] <= self.group_size:
            return super().forward(input)  # running statistics, or one group: plain BatchNorm
        self._check_input_dim(input)
        return torch.cat(
            [super(GhostBatchNorm, self).forward(group) for group in input.split(self.group_size)]
        )


def convert_to_ghost(module: nn.Module, group_size: int) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` by a :class:`GhostBatchNorm` of ``group_size`` rows that shares
    its parameters and running statistics (and its train/eval mode). Returns the new module when ``module`` is
    itself a BatchNorm layer; else converts in place and returns ``module``. A layer with global-batch statistics
    (``SyncBatchNorm``, ``CrossRankBatchNorm``) is refused: the two normalise different sets of images."""
    if isinstance(module, _BatchNorm) and not isinstance(module, GhostBatchNorm):
        if type(module) not in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
            raise ValueError(
                f"cannot turn a {type(module).__name__} into ghost batch normalisation: it normalises over the "
                "global batch (model.sync_bn) or is not a plain BatchNorm layer"
            )
        ghost = GhostBatchNorm(
            module.num_features,
            group_size,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        return take_over_batchnorm(ghost, module)
    for name, child in module.named_children():
        module.add_module(name, convert_to_ghost(child, group_size))
    return module
