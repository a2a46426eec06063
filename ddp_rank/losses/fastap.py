"""FastAP (Cakir et al., CVPR 2019): average precision from soft distance histograms.

For a query with positives P and negatives N (the query itself is neither), squared distances to unit rows
``d = 2 - 2 s`` lie in [0, 4]. With ``L = num_bins + 1`` bin centres ``z_l = l * delta``, ``delta = 4 /
num_bins``, and the triangular kernel ``K_l(d) = max(0, 1 - |d - z_l| / delta)``:

    h+_l = sum_{j in P} K_l(d_j)     h_l = h+_l + sum_{j in N} K_l(d_j)
    H+_l = cumsum(h+)_l              H_l = cumsum(h)_l
    FastAP = (1 / |P|) sum_l h+_l H+_l / H_l          (terms with H_l = 0 are 0)
    loss   = 1 - mean over queries with |P| > 0 of FastAP

Computation, with no scatter and no ``[c, N, L]`` tensor: the weights an item puts on bins ``0..l`` sum to
``C_l(t) = clamp(l + 1 - t, 0, 1)`` (``t = d / delta``), so the cumulative histogram of all items is
``H_l = sum_j C_l(t_j)``: a pass per bin over a few rows at a time (``[rows, L, N]``, in cache on CPU), or
one fused pass with Triton on CUDA (``kernel="auto"``, the default, or ``"triton"``); ``H+`` comes from the ``[c, P]`` same-class columns
alone, and ``h+`` is its difference. Scatter-adds into the two bins each item touches (the obvious way)
serialise on their atomics on a GPU, turn into a sort under deterministic algorithms, and on CPU cost about
10 ns an item, more than the whole ``[rows, L, N]`` pass.

Gradient (the supplement's eqs. 37-46, written per bin). With ``a_l = h+_l / H_l`` and
``b_l = h+_l H+_l / H_l^2``, and ``rc`` the reverse cumulative sum:

    dFastAP/dh+_m = (H+_m / H_m + rc(a)_m - rc(b)_m) / |P|
    dFastAP/dh-_m = -rc(b)_m / |P|

A distance in ``[z_l, z_{l+1}]`` moves bin l by ``-1/delta`` and bin l+1 by ``+1/delta``, so its gradient is
a difference of two adjacent per-bin values, read back with one gather (the positives' from the ``[c, P]``
columns). This is the true gradient of the forward above (the authors' hand-written backward is off by a
factor of ``n_valid / 2`` and ignores ``grad_output``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddp_rank.losses.base import SAME_CLASS_BYTES, ListwiseLoss, ListwiseOptions
from ddp_rank.losses.histogram import (
    bin_gradient,
    cumulative_histograms,
    cumulative_weights,
    histogram_pass_bytes,
)
from ddp_rank.losses.rows import ChunkInputs

if TYPE_CHECKING:  # PEP 692's Unpack, in typing from Python 3.11
    from typing_extensions import Unpack


class FastAPLoss(ListwiseLoss):
    """FastAP loss, exact and memory-linear.

    Args:
        num_bins: histogram intervals on [0, 4]; ``num_bins + 1`` bin centres (the authors' default is 10).
        normalize, memory_budget, chunk_rows, matmul_precision, kernel: see ``ListwiseLoss`` (``kernel``: the
            cumulative histograms and the bin gradient, plain torch passes or one fused pass each).

    Examples:
        A batch of 8 classes of 4 random rows, far from ranked (a loss of 0 is a perfect ranking):

        >>> import torch
        >>> from ddp_rank.losses import FastAPLoss
        >>> generator = torch.Generator().manual_seed(0)
        >>> embeddings = torch.randn(32, 8, generator=generator, requires_grad=True)
        >>> labels = torch.arange(32) // 4
        >>> loss = FastAPLoss(num_bins=10)(embeddings, labels)
        >>> round(loss.item(), 4)
        0.8681
        >>> loss.backward()
        >>> embeddings.grad.shape
        torch.Size([32, 8])
    """

    def __init__(
        self,
        num_bins: int = 10,
        **options: Unpack[ListwiseOptions],
    ) -> None:
        super().__init__(**options)
        if int(num_bins) != num_bins or num_bins < 1:
            raise ValueError(f"num_bins must be a positive integer, got {num_bins}")
        self.num_bins = int(num_bins)

    def hyper_parameters(self) -> dict[str, object]:
        return {**super().hyper_parameters(), "num_bins": self.num_bins}

    def extra_repr(self) -> str:
        return f"num_bins={self.num_bins}, normalize={self.normalize}"

    def _bytes_per_query_row(
        self, n_database: int, max_positives: int, itemsize: int, fused: bool = False
    ) -> int:
        # The block (bin positions, then the gradient over them), on the fused path a gradient row of its own,
        # and the same-class columns' cumulative kernel weights [P, L] (twice: the weights and their
        # masking); the torch path's levels and gradient keys are ``_pass_bytes_per_query_row``.
        per_column = (2 if fused else 1) * itemsize
        p = max(1, max_positives)
        return (
            n_database * per_column
            + 2 * p * (self.num_bins + 1) * itemsize
            + p * SAME_CLASS_BYTES
            + (0 if fused else self._pass_bytes_per_query_row(n_database, max_positives, itemsize))
        )

    def _pass_bytes_per_query_row(self, n_database: int, max_positives: int, itemsize: int) -> int:
        return histogram_pass_bytes(n_database, self.num_bins, itemsize)

    def _similarity_affine(self) -> tuple[float, float]:
        # Position on the bin axis, in bins: t = d / delta = (2 - 2 s) * num_bins / 4.
        return -self.num_bins / 2.0, self.num_bins / 2.0

    def _score_chunk(
        self, block: Tensor, chunk: ChunkInputs, need_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        t_cn = block
        n_rows = t_cn.shape[0]
        n_bins = self.num_bins

        # Distances are taken as clamped to [0, 4] (t to [0, num_bins]): rows a hair off unit length (rounding,
        # or within the tolerance of normalize=False) must not extrapolate the kernel, which could make the loss
        # negative. The block passes (``ddp_rank.losses.histogram``) clamp as they read; where the clamp is
        # active the gradient is 0, as for torch.clamp.
        #
        # Cumulative histograms directly, with no scatter: the kernel weights an item puts on bins 0..l sum to
        # C_l(t) = clamp(l + 1 - t, 0, 1), so H_l = sum_j C_l(t_j). Scatter-adds into a handful of bins per row
        # serialise on their atomics on a GPU and fall back to a sorting kernel under deterministic algorithms.
        H_all = cumulative_histograms(t_cn, n_bins, chunk.workspace, chunk.fused)
        # The same sums over the chunk's same-class columns ([c, P], P small): the positives, and the query's
        # own entry, which is neither positive nor negative. Padding repeats the query's column, masked out.
        same_index, same_mask = chunk.same_class()
        is_self = same_index == chunk.self_columns[:, None]
        positive = same_mask & ~is_self
        t_same = t_cn.gather(1, same_index)
        C_same = cumulative_weights(t_same.clamp(0, n_bins), n_bins)  # [c, P, L]
        H_pos = (C_same * positive[..., None]).sum(1)
        H = H_all - (C_same * (same_mask & is_self)[..., None]).sum(1)
        h_pos = torch.diff(H_pos, dim=1, prepend=H_pos.new_zeros(n_rows, 1))
        n_pos = positive.sum(1).to(t_cn.dtype)

        H_safe = torch.where(H > 0, H, torch.ones_like(H))
        valid = n_pos > 0
        n_pos_safe = n_pos.clamp(min=1)
        fastap = (h_pos * H_pos / H_safe).sum(1) / n_pos_safe
        losses = torch.where(valid, 1.0 - fastap, torch.zeros_like(fastap))
        if not need_grad:
            return losses, valid, None

        a = h_pos / H_safe
        b = a * H_pos / H_safe
        rc_a, rc_b = _reverse_cumsum(a), _reverse_cumsum(b)
        # d(loss)/dh per bin; loss = 1 - FastAP, invalid queries contribute nothing.
        scale = (valid / n_pos_safe)[:, None]
        dloss_dh_pos = -(H_pos / H_safe + rc_a - rc_b) * scale
        dloss_dh_neg = rc_b * scale
        # d(loss)/dt of an item whose lower bin is l (kernel slopes -1 on bin l, +1 on bin l + 1): a table per
        # query, read with one gather for every column as if negative, then the positives' own values written
        # over their columns. Every write to the query's column (its own entry and the padding) is 0.
        slope_neg = dloss_dh_neg[:, 1:] - dloss_dh_neg[:, :-1]
        slope_pos = dloss_dh_pos[:, 1:] - dloss_dh_pos[:, :-1]
        # The torch path writes it over the positions (each row read before it is written), the fused one
        # into a buffer of its own.
        out = chunk.workspace.take("scratch", t_cn.shape, t_cn.dtype) if chunk.fused else t_cn
        grad = bin_gradient(t_cn, slope_neg, out, chunk.workspace, chunk.fused)
        # The same read for the same-class columns, from the positives' table (its keys reuse the block's buffers).
        slopes_same = bin_gradient(t_same, slope_pos, torch.empty_like(t_same), chunk.workspace, chunk.fused)
        grad_same = torch.where(positive, slopes_same, torch.zeros_like(slopes_same))
        # index_put_ (not scatter_): deterministic on CUDA under deterministic algorithms; the repeated query
        # column receives only zeros, so the order of its writes does not matter anyway.
        rows = torch.arange(n_rows, device=t_cn.device)[:, None].expand_as(same_index)
        return losses, valid, grad.index_put_((rows, same_index), grad_same)


def _reverse_cumsum(x: Tensor) -> Tensor:
    """``out[:, m] = sum_{l >= m} x[:, l]``."""
    return torch.flip(torch.cumsum(torch.flip(x, (1,)), 1), (1,))
