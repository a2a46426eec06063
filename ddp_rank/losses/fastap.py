"""FastAP (Cakir et al., CVPR 2019): average precision from soft distance histograms.

For a query with positives P and negatives N (the query itself is neither), squared distances to unit rows
``d = 2 - 2 s`` lie in [0, 4]. With ``L = num_bins + 1`` bin centres ``z_l = l * delta``, ``delta = 4 /
num_bins``, and the triangular kernel ``K_l(d) = max(0, 1 - |d - z_l| / delta)``:

    h+_l = sum_{j in P} K_l(d_j)     h_l = h+_l + sum_{j in N} K_l(d_j)
    H+_l = cumsum(h+)_l              H_l = cumsum(h)_l
    FastAP = (1 / |P|) sum_l h+_l H+_l / H_l          (terms with H_l = 0 are 0)
    loss   = 1 - mean over queries with |P| > 0 of FastAP

Memory: a distance lies between two adjacent centres and touches only those two bins, with weights
``1 - frac`` and ``frac``; the histograms are therefore two scatter-adds over ``[c, N]`` whatever
``num_bins`` is, and ``[c, N, L]`` never exists.

Gradient (the supplement's eqs. 37-46, written for scatter/gather). With ``a_l = h+_l / H_l`` and
``b_l = h+_l H+_l / H_l^2``, and ``rc`` the reverse cumulative sum:

    dFastAP/dh+_m = (H+_m / H_m + rc(a)_m - rc(b)_m) / |P|
    dFastAP/dh-_m = -rc(b)_m / |P|

A distance in ``[z_l, z_{l+1}]`` moves bin l by ``-1/delta`` and bin l+1 by ``+1/delta``, so its gradient is
a difference of two adjacent per-bin values, read back with one gather. This is the true gradient of the
forward above (the authors' hand-written backward is off by a factor of ``n_valid / 2`` and ignores
``grad_output``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddp_rank.losses.base import ListwiseLoss
from ddp_rank.losses.rows import ChunkInputs


class FastAPLoss(ListwiseLoss):
    """FastAP loss, exact and memory-linear.

    Args:
        num_bins: histogram intervals on [0, 4]; ``num_bins + 1`` bin centres (the authors' default is 10).
        normalize, memory_budget, chunk_rows: see ``ListwiseLoss``.
    """

    def __init__(
        self,
        num_bins: int = 10,
        *,
        normalize: bool = True,
        memory_budget: int | None = None,
        chunk_rows: int | None = None,
        matmul_precision: str = "highest",
    ) -> None:
        super().__init__(
            normalize=normalize,
            memory_budget=memory_budget,
            chunk_rows=chunk_rows,
            matmul_precision=matmul_precision,
        )
        if int(num_bins) != num_bins or num_bins < 1:
            raise ValueError(f"num_bins must be a positive integer, got {num_bins}")
        self.num_bins = int(num_bins)

    def hyper_parameters(self) -> dict[str, object]:
        return {**super().hyper_parameters(), "num_bins": self.num_bins}

    def extra_repr(self) -> str:
        return f"num_bins={self.num_bins}, normalize={self.normalize}"

    def _bytes_per_query_row(self, n_database: int, max_positives: int, itemsize: int) -> int:
        # The block (bin positions, then fractions, then G), the lower bins and the int64 histogram slots.
        return n_database * (2 * itemsize + 8)

    def _similarity_affine(self) -> tuple[float, float]:
        # Position on the bin axis, in bins: t = d / delta = (2 - 2 s) * num_bins / 4.
        return -self.num_bins / 2.0, self.num_bins / 2.0

    def _score_chunk(
        self, block: Tensor, chunk: ChunkInputs, need_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        t_cn = block
        n_rows = t_cn.shape[0]
        n_bins = self.num_bins
        n_centres = n_bins + 1
        trash = 2 * n_centres  # histogram slot that swallows each query's own column

        # Distances are clamped to [0, 4] (t to [0, num_bins]): rows a hair off unit length (rounding, or within
        # the tolerance of normalize=False) must not extrapolate the kernel, which could make the loss
        # negative. Where the clamp is active the gradient is 0, as for torch.clamp.
        outside = (t_cn < 0) | (t_cn > n_bins) if need_grad else None
        t_cn.clamp_(0, n_bins)
        low_cn = torch.floor(t_cn, out=chunk.workspace.take("low", t_cn.shape, t_cn.dtype)).clamp_(
            0, n_bins - 1
        )
        frac_cn = t_cn.sub_(low_cn)
        # Histogram slot of each item's lower bin: negatives in [L, 2L), positives in [0, L), the query in
        # the trash slot. Same-class columns come from the label index, so no [c, N] label comparison.
        same_index, _ = chunk.same_class()  # padding repeats the query's column: harmless here
        low_same = low_cn.gather(1, same_index)
        slot_f = low_cn.add_(n_centres)
        slot_f.scatter_(1, same_index, low_same)
        slot_f[torch.arange(n_rows, device=t_cn.device), chunk.self_columns] = trash
        slot_cn = chunk.workspace.take("slot", t_cn.shape, torch.int64).copy_(slot_f)
        del low_cn, slot_f, low_same

        # Each item adds (1 - frac) to its lower bin and frac to the next one:
        # h[l] = count[l] - frac_sum[l] + frac_sum[l - 1].
        count = t_cn.new_zeros(n_rows, trash + 1)
        count.scatter_add_(1, slot_cn, t_cn.new_ones(()).expand_as(frac_cn))
        frac_sum = t_cn.new_zeros(n_rows, trash + 1).scatter_add_(1, slot_cn, frac_cn)
        hist = count - frac_sum
        hist[:, 1:] += frac_sum[:, :-1]
        h_pos, h_neg = hist[:, :n_centres], hist[:, n_centres:trash]
        n_pos = count[:, :n_centres].sum(1)

        H_pos = torch.cumsum(h_pos, 1)
        H = torch.cumsum(h_pos + h_neg, 1)
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
        # Per slot: d(loss)/dt for an item whose lower bin is that slot (kernel slopes -1, +1 per bin).
        slope = t_cn.new_zeros(n_rows, trash + 1)
        slope[:, : n_centres - 1] = dloss_dh_pos[:, 1:] - dloss_dh_pos[:, :-1]
        slope[:, n_centres : trash - 1] = dloss_dh_neg[:, 1:] - dloss_dh_neg[:, :-1]
        # The block (now the fractions) is no longer needed: the gradient goes into its memory.
        grad = torch.gather(slope, 1, slot_cn, out=frac_cn)
        assert outside is not None
        return losses, valid, grad.masked_fill_(outside, 0.0)


def _reverse_cumsum(x: Tensor) -> Tensor:
    """``out[:, m] = sum_{l >= m} x[:, l]``."""
    return torch.flip(torch.cumsum(torch.flip(x, (1,)), 1), (1,))
