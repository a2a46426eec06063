"""The sigmoid ranks PNP and Smooth-AP share, and their similarity gradient.

For a block of scores ``s [c, N]`` (``S / tau``) and each query's same-class columns ``index [c, P]``:

    R[a, i] = sum_{j in N_a} sigmoid(s_aj - s_a,index[a, i])       (negatives ranked above same-class item i)

and, for ``w = d(loss)/dR [c, P]`` and ``sigma' = sigma (1 - sigma)``, the gradient of the loss with respect
to the scores:

    G[a, j in N_a] = sum_i w_ai sigma'_aij             G[a, index[a, i]] -= w_ai sum_j sigma'_aij

Both losses' ``w`` of a row depends on that row's ranks alone, so the caller passes it as a function of
them, and the ranks and the gradient come out of one sweep over the block. Two implementations:

- ``torch``: the sigmoids of a few rows as a ``[rows, P, N]`` tensor (subtraction, sigmoid, sum, derivative,
  one batched matmul, sum), written over the rows' scores. On CPU the rows go in sub-blocks whose sigmoids stay
  in cache (``rows.pass_row_blocks``), so that the six passes over them read cache, not memory, and no
  sigmoid is computed twice. Runs anywhere.
- ``triton``: two fused passes over ``[c, N]`` (``triton_kernels.py``): one for ``R`` and the slope sums
  ``sum_j sigma'``, one for ``G``; the ``[c, P, N]`` tensor never exists. Where they cannot run, the torch
  path does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ddp_rank.losses.rows import Workspace, pass_row_blocks
from ddp_rank.losses.triton_kernels import fused_sigmoid_rank_gradient, fused_sigmoid_rank_sums

__all__ = ["NegativeRanks", "RankWeights", "add_rank_gradient"]

RankWeights = Callable[[Tensor, slice], Tensor]
"""``(R [rows, P], rows) -> d(loss)/dR [rows, P]`` for the block's rows ``rows``."""


class NegativeRanks:
    """``R [c, P]`` of one block and, given ``dloss_dranks``, the gradient ``G [c, N] = d(loss)/d scores``.

    Consumes ``scores``: their same-class columns are set to -inf, so that the sigmoid and its derivative are
    exactly 0 there and no mask pass is needed; the torch path then writes ``G`` over them, the fused path
    into a workspace buffer (``fused``: the Triton passes, where ``fused_kernels_run``).

    Attributes:
        values: ``R [c, P]``.
        same_scores: ``[c, P]``, the scores of the same-class columns (taken before they were masked).
        gradient: ``G [c, N]``, or None without ``dloss_dranks``.
    """

    def __init__(
        self,
        scores: Tensor,
        index: Tensor,
        workspace: Workspace,
        fused: bool = False,
        dloss_dranks: RankWeights | None = None,
    ) -> None:
        self.same_scores = scores.gather(1, index)
        scores.scatter_(1, index, -math.inf)
        self.gradient: Tensor | None = None
        if fused:
            self.values, slope_sums = fused_sigmoid_rank_sums(scores, self.same_scores)
            if dloss_dranks is not None:
                w = dloss_dranks(self.values, slice(None))
                out = workspace.take("rank_gradient", tuple(scores.shape), torch.float32)
                grad = fused_sigmoid_rank_gradient(scores, self.same_scores, w, out)
                self.gradient = grad.scatter_add_(1, index, -w * slope_sums)
            return
        c, p = index.shape
        n_cols = scores.shape[1]
        self.values = scores.new_empty(c, p)
        for rows in pass_row_blocks(c, p * n_cols * scores.element_size(), workspace):
            s_rows = scores[rows]
            sigma = workspace.take("sigma", (s_rows.shape[0], p, n_cols), scores.dtype)
            torch.sub(s_rows[:, None, :], self.same_scores[rows, :, None], out=sigma).sigmoid_()
            ranks = self.values[rows] = sigma.sum(2)
            if dloss_dranks is not None:  # the rows' scores are spent: their gradient goes over them
                w = dloss_dranks(ranks, rows)
                dsigma = sigma.addcmul_(sigma, sigma, value=-1.0)  # sigma (1 - sigma)
                torch.bmm(w[:, None, :], dsigma, out=s_rows[:, None, :])
                s_rows.scatter_add_(1, index[rows], -w * dsigma.sum(2))
        if dloss_dranks is not None:
            self.gradient = scores


def add_rank_gradient(g_cn: Tensor, sigma_cpn: Tensor, index: Tensor, dloss_dranks: Tensor) -> None:
    """Add ``d(loss)/d scores`` for ``R[a, i] = sum_j sigma(scores[a, j] - scores[a, index[a, i]])``.

    Given ``d(loss)/dR [c, P]``: every j gets ``sum_i dloss/dR_ai sigma'_aij``, every ``index[a, i]`` loses
    ``dloss/dR_ai sum_j sigma'_aij``. Consumes ``sigma_cpn`` (turned into its derivative in place).
    """
    dsigma_cpn = sigma_cpn.addcmul_(sigma_cpn, sigma_cpn, value=-1.0)  # sigma (1 - sigma)
    g_cn += torch.bmm(dloss_dranks[:, None, :], dsigma_cpn).squeeze(1)
    g_cn.scatter_add_(1, index, -dloss_dranks * dsigma_cpn.sum(2))
