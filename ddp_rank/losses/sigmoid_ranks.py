"""The sigmoid ranks PNP and Smooth-AP share, and their similarity gradient.

For a block of scores ``s [c, N]`` (``S / tau``) and each query's same-class columns ``index [c, P]``:

    R[a, i] = sum_{j in N_a} sigmoid(s_aj - s_a,index[a, i])       (negatives ranked above same-class item i)

and, for ``w = d(loss)/dR [c, P]`` and ``sigma' = sigma (1 - sigma)``, the gradient of the loss with respect
to the scores:

    G[a, j in N_a] = sum_i w_ai sigma'_aij             G[a, index[a, i]] -= w_ai sum_j sigma'_aij

Both losses' ``w`` of a row depends on that row's ranks alone, so the caller passes it as a function of
them, and the ranks and the gradient come out of one sweep over the block. Three implementations:

- ``torch``: the sigmoids of a few rows as a ``[rows, P, N]`` tensor (subtraction, sigmoid, sum, derivative,
  one batched matmul, sum), written over the rows' scores. On CPU the rows go in sub-blocks whose sigmoids stay
  in cache (``rows.pass_row_blocks``), so that the six passes over them read cache, not memory, and no
  sigmoid is computed twice. Runs anywhere.
- ``triton``: two fused passes over ``[c, N]`` (``triton_kernels.py``): one for ``R`` and the slope sums
  ``sum_j sigma'``, one for ``G``; the ``[c, P, N]`` tensor never exists. Where they cannot run, the torch
  path does.
- ``native``: the torch path's sweep with its passes as C compiled for the CPU (``cpu_kernels.py``, where
  ``workspace.native``): per sub-block, one pass for ``R``, the slope sums and ``sigma'`` (one exponential per
  column for all of a row's positives), and one for ``G``. Taken on one thread only
  (``SigmoidRankLoss.takes_native_passes``): on the 2-core test machine they did not scale to two threads and
  were then slower than the torch path, whose ops each split over the threads (1.34-1.40x the floor against
  1.30-1.36x; ``benchmarks/results/loss-floor-2026-11-29.md``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ddp_rank.losses.base import SAME_CLASS_BYTES, ListwiseLoss, ListwiseOptions
from ddp_rank.losses.checks import check_positive
from ddp_rank.losses.cpu_kernels import native_sigmoid_rank_gradient, native_sigmoid_rank_sums
from ddp_rank.losses.rows import Workspace, pass_row_blocks
from ddp_rank.losses.triton_kernels import fused_sigmoid_rank_gradient, fused_sigmoid_rank_sums

if TYPE_CHECKING:  # PEP 692's Unpack, in typing from Python 3.11
    from typing_extensions import Unpack

__all__ = ["NegativeRanks", "RankWeights", "SigmoidRankLoss", "add_rank_gradient", "counted_positives"]

RankWeights = Callable[[Tensor, slice], Tensor]
"""``(R [rows, P], rows) -> d(loss)/dR [rows, P]`` for the block's rows ``rows``."""


class SigmoidRankLoss(ListwiseLoss):
    """Base of the losses whose ranks are sums of sigmoids of score differences (PNP, Smooth-AP): the scores
    ``S / tau``, which positives count (``count_self``), and the work space of :class:`NegativeRanks`."""

    def __init__(self, tau: float, count_self: bool, **options: Unpack[ListwiseOptions]) -> None:
        super().__init__(**options)
        self.tau, self.count_self = check_positive("tau", tau), count_self

    def hyper_parameters(self) -> dict[str, object]:
        return {**super().hyper_parameters(), "tau": self.tau, "count_self": self.count_self}

    def _positive_pair_bytes(self, max_positives: int, itemsize: int) -> int:
        """Work space a query row holds for ``[P, P]`` values among its positives (0 unless a family has some)."""
        return 0

    def _bytes_per_query_row(
        self, n_database: int, max_positives: int, itemsize: int, fused: bool = False
    ) -> int:
        # The block (scores, then G over them), G's own buffer on the fused path, the family's [P, P] values;
        # the torch path's [P, N] sigmoids are ``_pass_bytes_per_query_row``.
        p = max(1, max_positives)
        per_column = 2 if fused else 1
        return (
            per_column * n_database * itemsize
            + self._positive_pair_bytes(p, itemsize)
            + p * SAME_CLASS_BYTES
            + (0 if fused else self._pass_bytes_per_query_row(n_database, max_positives, itemsize))
        )

    def _pass_bytes_per_query_row(self, n_database: int, max_positives: int, itemsize: int) -> int:
        return max(1, max_positives) * n_database * itemsize

    def _similarity_affine(self) -> tuple[float, float]:
        return 1.0 / self.tau, 0.0

    def takes_native_passes(self, device: torch.device, dtype: torch.dtype) -> bool:
        """The compiled rank passes on one thread only (the module docstring says why)."""
        return torch.get_num_threads() == 1 and super().takes_native_passes(device, dtype)


def counted_positives(
    same_index: Tensor, same_mask: Tensor, self_columns: Tensor, count_self: bool
) -> Tensor:
    """[c, P] mask of the same-class columns that count as positives (the query only with ``count_self``)."""
    return same_mask if count_self else same_mask & (same_index != self_columns[:, None])


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
        if workspace.native:
            self._native_sweep(scores, index, workspace, dloss_dranks)
            return
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

    def _native_sweep(
        self, scores: Tensor, index: Tensor, workspace: Workspace, dloss_dranks: RankWeights | None
    ) -> None:
        """The torch path's sweep with the compiled passes: per sub-block, ``R`` and ``sigma'``, then ``G``
        over the rows' spent scores from the ``sigma'`` the first pass kept."""
        c, p = index.shape
        n_cols = scores.shape[1]
        for rows in pass_row_blocks(c, p * n_cols * 4, workspace):
            s_rows = scores[rows]
            shape = (s_rows.shape[0], p, n_cols)
            dsigma = None if dloss_dranks is None else workspace.take("sigma", shape, torch.float32)
            ranks, slope_sums = native_sigmoid_rank_sums(s_rows, self.same_scores[rows], dsigma)
            self.values[rows] = ranks
            if dloss_dranks is not None and dsigma is not None:
                w = dloss_dranks(ranks, rows)
                native_sigmoid_rank_gradient(dsigma, w, s_rows)
                s_rows.scatter_add_(1, index[rows], -w * slope_sums)
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
