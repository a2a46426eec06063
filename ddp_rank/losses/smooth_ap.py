"""Smooth-AP (Brown et al., ECCV 2020): AP with the rank indicator replaced by a sigmoid.

For a query ``a`` with positives ``P_a`` and ``sigma_aij = sigmoid((s_aj - s_ai) / tau)``:

    Rp[a, i] = 1 + sum_{j in P_a, j != i} sigma_aij          (smoothed rank of i among the positives)
    Ra[a, i] = Rp[a, i] + sum_{j in N_a} sigma_aij            (smoothed rank of i among everything)
    loss     = 1 - mean over valid queries of (1 / |P_a|) sum_{i in P_a} Rp[a, i] / Ra[a, i]

``count_self=True`` follows the authors' code (and ROADMAP's): the query is one of its own positives and of
the ranked items, so every query is valid; ``count_self=False`` leaves the query out of its ranking and a
query with no other positive out of the mean.

Memory: ``[c, P, N]`` for the negatives and ``[c, P, P]`` among the positives, never ``[N, N, N]``. With
``Rn = Ra - Rp``, ``dT/dRp = Rn / Ra^2`` and ``dT/dRn = -Rp / Ra^2`` for ``T = Rp / Ra``; both sums are
sigmoid ranks, whose similarity gradient ``sigmoid_ranks.py`` (shared with PNP) computes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddp_rank.losses.base import ListwiseOptions
from ddp_rank.losses.rows import ChunkInputs
from ddp_rank.losses.sigmoid_ranks import NegativeRanks, SigmoidRankLoss, add_rank_gradient, counted_positives

if TYPE_CHECKING:  # PEP 692's Unpack, in typing from Python 3.11
    from typing_extensions import Unpack


class SmoothAPLoss(SigmoidRankLoss):
    """Smooth-AP, exact and memory-linear (the authors' code builds ``[N, N, N]``).

    Args:
        tau: sigmoid temperature.
        count_self: count the query among its own positives, as the authors' code does. Then EVERY query is
            valid, a singleton too (its AP is 1: its only positive, itself, ranks first), so singletons count
            in the mean; with ``False`` a query without another positive is left out of it, as in FastAPLoss
            and PNPLoss (where that holds for both settings).
        normalize, memory_budget, chunk_rows, matmul_precision, kernel: see ``ListwiseLoss`` (``kernel``: the
            ranks among the negatives through ``[c, P, N]`` or two fused passes).

    Examples:
        ``tau=0.01`` is the temperature of Brown et al. (2020). With the authors' ``count_self=True`` the query
        ranks first among its own positives, which lowers the loss against the paper's definition:

        >>> import torch
        >>> from ddp_rank.losses import SmoothAPLoss
        >>> embeddings = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))
        >>> labels = torch.arange(32) // 4  # 8 classes of 4
        >>> [round(SmoothAPLoss(tau=0.01, count_self=c)(embeddings, labels).item(), 4) for c in (True, False)]
        [0.5755, 0.8251]
    """

    def __init__(
        self,
        tau: float = 0.01,
        count_self: bool = True,
        **options: Unpack[ListwiseOptions],
    ) -> None:
        super().__init__(tau, count_self, **options)

    def extra_repr(self) -> str:
        return f"tau={self.tau}, count_self={self.count_self}, normalize={self.normalize}"

    def _positive_pair_bytes(self, max_positives: int, itemsize: int) -> int:
        return 2 * max_positives * max_positives * itemsize  # the [P, P] sigmoids among the positives

    def _score_chunk(
        self, block: Tensor, chunk: ChunkInputs, need_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        same_index, same_mask = chunk.same_class()
        pos_mask = counted_positives(same_index, same_mask, chunk.self_columns, self.count_self)
        n_pos = pos_mask.sum(1)
        valid = n_pos > 0
        weights = pos_mask.to(block.dtype) / n_pos.clamp(min=1)[:, None]  # [c, P]; 0 if invalid

        # Ranks among the positives first (their gradient needs them): the same sigmoids on the [c, P, P]
        # block of positive scores.
        s_pos = block.gather(1, same_index)
        others = pos_mask[:, None, :] & ~torch.eye(same_index.shape[1], dtype=torch.bool, device=block.device)
        sigma_cpp = torch.sub(s_pos[:, None, :], s_pos[:, :, None]).sigmoid_().mul_(others)
        ranks_pos = 1 + sigma_cpp.sum(2)

        # loss = 1 - sum_i w_i Rp_i / Ra_i with Ra = Rp + Rn.
        def dloss_dranks_neg(ranks_neg: Tensor, rows: slice) -> Tensor:
            return weights[rows] * ranks_pos[rows] / (ranks_pos[rows] + ranks_neg) ** 2

        negatives = NegativeRanks(
            block, same_index, chunk.workspace, chunk.fused, dloss_dranks_neg if need_grad else None
        )
        ranks_neg = negatives.values
        ranks_all = ranks_pos + ranks_neg
        precision = ranks_pos / ranks_all
        losses = valid.to(precision.dtype) - (precision * weights).sum(1)  # 1 - mean precision; 0 if invalid
        if negatives.gradient is None:
            return losses, valid, None

        dloss_dranks_pos = -weights * ranks_neg / ranks_all**2
        g_cn = negatives.gradient
        g_cp = block.new_zeros(s_pos.shape)
        within = torch.arange(same_index.shape[1], device=block.device).expand_as(same_index)
        add_rank_gradient(g_cp, sigma_cpp, within, dloss_dranks_pos)
        g_cn.scatter_add_(1, same_index, g_cp)
        return losses, valid, g_cn
