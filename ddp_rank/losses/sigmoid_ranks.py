"""The sigmoid ranks PNP and Smooth-AP share, and their similarity gradient.

For a block of scores ``s [c, N]`` (``S / tau``) and each query's same-class columns ``index [c, P]``:

    R[a, i] = sum_{j in N_a} sigmoid(s_aj - s_a,index[a, i])       (negatives ranked above same-class item i)

and, for ``w = d(loss)/dR [c, P]`` and ``sigma' = sigma (1 - sigma)``, the gradient of the loss with respect
to the scores:

    G[a, j in N_a] = sum_i w_ai sigma'_aij             G[a, index[a, i]] -= w_ai sum_j sigma'_aij

Two implementations of one function:

- ``torch``: the sigmoids as a ``[c, P, N]`` tensor, read and written about eight times (subtraction,
  sigmoid, sum, derivative, one batched matmul, sum). Runs anywhere.
- ``triton``: two fused passes over ``[c, N]`` (``triton_kernels.py``): one for ``R`` and the slope sums
  ``sum_j sigma'``, one for ``G``; the ``[c, P, N]`` tensor never exists. Where they cannot run, the torch
  path does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ddp_rank.losses.rows import Workspace
from ddp_rank.losses.triton_kernels import fused_sigmoid_rank_gradient, fused_sigmoid_rank_sums

__all__ = ["NegativeRanks", "add_rank_gradient"]


class NegativeRanks:
    """``R [c, P]`` of one block, and what its gradient needs.

    Consumes ``scores``: their same-class columns are set to -inf, so that the sigmoid and its derivative are
    exactly 0 there and no mask pass is needed; ``gradient`` then reuses the block's memory (torch path) or
    a workspace buffer (``fused``: the Triton passes, where ``fused_kernels_run``).

    Attributes:
        values: ``R [c, P]``.
        same_scores: ``[c, P]``, the scores of the same-class columns (taken before they were masked).
    """

    def __init__(self, scores: Tensor, index: Tensor, workspace: Workspace, fused: bool = False) -> None:
        self.same_scores = scores.gather(1, index)
        scores.scatter_(1, index, -math.inf)
        self._scores, self._index, self._workspace = scores, index, workspace
        self._sigma: Tensor | None = None
        if fused:
            self.values, self._slope_sums = fused_sigmoid_rank_sums(scores, self.same_scores)
            return
        c, p = index.shape
        sigma = workspace.take("sigma", (c, p, scores.shape[1]), scores.dtype)
        torch.sub(scores[:, None, :], self.same_scores[:, :, None], out=sigma).sigmoid_()
        self._sigma, self.values = sigma, sigma.sum(2)

    def gradient(self, dloss_dranks: Tensor) -> Tensor:
        """``G [c, N] = d(loss)/d scores`` from ``d(loss)/dR [c, P]``; call once."""
        if self._sigma is None:
            out = self._workspace.take("rank_gradient", tuple(self._scores.shape), torch.float32)
            grad = fused_sigmoid_rank_gradient(self._scores, self.same_scores, dloss_dranks, out)
            grad.scatter_add_(1, self._index, -dloss_dranks * self._slope_sums)
            return grad
        grad = self._scores.zero_()  # the scores are spent: reuse their memory
        add_rank_gradient(grad, self._sigma, self._index, dloss_dranks)
        return grad


def add_rank_gradient(g_cn: Tensor, sigma_cpn: Tensor, index: Tensor, dloss_dranks: Tensor) -> None:
    """Add ``d(loss)/d scores`` for ``R[a, i] = sum_j sigma(scores[a, j] - scores[a, index[a, i]])``.

    Given ``d(loss)/dR [c, P]``: every j gets ``sum_i dloss/dR_ai sigma'_aij``, every ``index[a, i]`` loses
    ``dloss/dR_ai sum_j sigma'_aij``. Consumes ``sigma_cpn`` (turned into its derivative in place).
    """
    dsigma_cpn = sigma_cpn.addcmul_(sigma_cpn, sigma_cpn, value=-1.0)  # sigma (1 - sigma)
    g_cn += torch.bmm(dloss_dranks[:, None, :], dsigma_cpn).squeeze(1)
    g_cn.scatter_add_(1, index, -dloss_dranks * dsigma_cpn.sum(2))
