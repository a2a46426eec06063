"""PNP (Li et al., AAAI 2022): penalise only the negatives ranked before each positive.

For a query ``a`` with positives ``P_a`` and negatives ``N_a``, and similarities ``s = x . x``:

    R[a, i] = sum_{j in N_a} sigmoid((s_aj - s_ai) / tau)        (a smoothed count of negatives above i)
    loss    = mean over queries with a positive of (1 / |P_a|) sum_{i in P_a} f(R[a, i])

with the five variants of the paper (eqs. 5-13):

    O:  f = R                      Iu: f = (1 + R) log(1 + R)      Ib: f = (b R - log(1 + b R)) / b^2
    Ds: f = log(1 + R)             Dq: f = -(1 + R)^-alpha, loss = 1 - mean (1 + R)^-alpha

``count_self=True`` reproduces the authors' code, which counts the query in its own ``P_a`` (its R is about 0,
so with classes of size g the loss is scaled by (g - 1)/g against the paper); ``count_self=False`` is the
paper's definition. A query without a positive besides itself is left out of the mean either way.

Memory: only (query, positive) pairs need a rank, so a chunk of c queries builds ``[c, P, N]`` (P the largest
positive set in the batch) instead of the authors' ``[N, N, N]``. With ``c_ai = f'(R_ai) / |P_a|`` and
``sigma'_aij = sigma(1 - sigma) / tau``, the similarity gradient is

    G[a, j in N_a] =  sum_i c_ai sigma'_aij            G[a, i in P_a] -= c_ai sum_j sigma'_aij

(``sigmoid_ranks.py``: one batched matmul and one scatter-add, two fused Triton passes with no
``[c, P, N]`` at all, or the compiled CPU passes). The authors clamp the sigmoid's argument to [-50, 50]; this only
guards their exp against overflow (``torch.sigmoid`` needs no guard) and changes values by < 2e-22.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddp_rank.losses.base import ListwiseOptions
from ddp_rank.losses.checks import check_positive
from ddp_rank.losses.rows import ChunkInputs
from ddp_rank.losses.sigmoid_ranks import NegativeRanks, SigmoidRankLoss, counted_positives

VARIANTS = ("O", "Iu", "Ib", "Ds", "Dq")


if TYPE_CHECKING:  # PEP 692's Unpack, in typing from Python 3.11
    from typing_extensions import Unpack


class PNPLoss(SigmoidRankLoss):
    """PNP loss in its five variants, from the labels (any class sizes, any order).

    Args:
        variant: "O", "Iu", "Ib", "Ds" or "Dq" (the paper's best is "Dq").
        tau: sigmoid temperature.
        b: the slope of variant "Ib".
        alpha: the exponent of variant "Dq".
        count_self: count the query among its own positives, as the authors' code does.
        normalize, memory_budget, chunk_rows, matmul_precision, kernel: see ``ListwiseLoss`` (``kernel``: the
            sigmoid ranks through ``[c, P, N]`` or two fused passes).

    Examples:
        PNP-Dq with the steeper ``alpha=4`` of the SOP recipe (``configs/sop_pnp_dq_resnet50_m384.yaml``; the
        paper asks for the largest alpha that still trains), and PNP-Ds, on 8 classes of 4 random rows:

        >>> import torch
        >>> from ddp_rank.losses import PNPLoss
        >>> generator = torch.Generator().manual_seed(0)
        >>> embeddings = torch.randn(32, 8, generator=generator, requires_grad=True)
        >>> labels = torch.arange(32) // 4
        >>> loss = PNPLoss("Dq", alpha=4.0)(embeddings, labels)
        >>> round(loss.item(), 4)
        0.7219
        >>> loss.backward()
        >>> round(PNPLoss("Ds")(embeddings, labels).item(), 4)  # log(1 + R): unbounded, unlike Dq's 1 - ...
        1.9123
    """

    def __init__(
        self,
        variant: str = "Dq",
        tau: float = 0.01,
        b: float = 2.0,
        alpha: float = 1.0,
        count_self: bool = True,
        **options: Unpack[ListwiseOptions],
    ) -> None:
        super().__init__(tau, count_self, **options)
        if variant not in VARIANTS:
            raise ValueError(f"unknown PNP variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        self.variant = variant
        self.b, self.alpha = check_positive("b", b), check_positive("alpha", alpha)

    def hyper_parameters(self) -> dict[str, object]:
        return {**super().hyper_parameters(), "variant": self.variant, "b": self.b, "alpha": self.alpha}

    def extra_repr(self) -> str:
        return (
            f"variant={self.variant!r}, tau={self.tau}, b={self.b}, alpha={self.alpha}, "
            f"count_self={self.count_self}, normalize={self.normalize}"
        )

    def _score_chunk(
        self, block: Tensor, chunk: ChunkInputs, need_grad: bool
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        same_index, same_mask = chunk.same_class()
        pos_mask = counted_positives(same_index, same_mask, chunk.self_columns, self.count_self)
        valid = same_mask.sum(1) > 1  # a positive besides the query itself
        weights = pos_mask.to(block.dtype)
        weights *= valid[:, None] / weights.sum(1, keepdim=True).clamp(min=1)  # [c, P]

        def dloss_dranks(ranks: Tensor, rows: slice) -> Tensor:
            return self._penalty(ranks)[1] * weights[rows]

        ranks = NegativeRanks(
            block, same_index, chunk.workspace, chunk.fused, dloss_dranks if need_grad else None
        )
        losses = (self._penalty(ranks.values)[0] * weights).sum(1)
        if self.variant == "Dq":  # 1 - mean (1 + R)^-alpha, with f = -(1 + R)^-alpha
            losses += valid
        return losses, valid, ranks.gradient

    def _penalty(self, ranks: Tensor) -> tuple[Tensor, Tensor]:
        """``(f(R), df/dR)`` of the variant ("Dq": ``f = -(1 + R)^-alpha``, its loss adds 1 to valid queries)."""
        if self.variant == "O":
            return ranks, torch.ones_like(ranks)
        if self.variant == "Iu":
            log1p = torch.log1p(ranks)
            return (1 + ranks) * log1p, log1p + 1
        if self.variant == "Ib":
            b = self.b
            return (b * ranks - torch.log1p(b * ranks)) / b**2, ranks / (1 + b * ranks)
        if self.variant == "Ds":
            return torch.log1p(ranks), 1 / (1 + ranks)
        power = (1 + ranks) ** -self.alpha
        return -power, self.alpha * power / (1 + ranks)
