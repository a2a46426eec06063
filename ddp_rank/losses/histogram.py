"""FastAP's passes over a block of bin positions ``t [c, N]``: cumulative soft histograms and the gradient.

Positions are taken as clamped to ``[0, num_bins]`` (rows a hair off unit length must not extrapolate the
kernel), without a clamping pass over the block: the histograms below saturate at both ends by themselves,
and the gradient is 0 where the clamp is active, as for ``torch.clamp``.

Two implementations of each:

- ``torch``: plain tensor ops through a ``[c, N]`` scratch buffer; runs anywhere. The histograms take one
  subtraction, one clamp and one row sum per bin, reading and writing the block about five times per bin.
- ``triton``: one fused pass each (``triton_kernels.py``): the histograms keep all the bins' sums of a row in
  registers, so the block is read once whatever the number of bins. Where they cannot run, the torch path does.

Both form every ``clamp(l + 1 - t, 0, 1)`` before adding it: summing ``clamp(t, l, l + 1)`` and subtracting the
total from ``(l + 1) N`` would cancel away float32's digits at large N.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddp_rank.losses.rows import Workspace
from ddp_rank.losses.triton_kernels import fused_bin_gradient, fused_cumulative_histograms

__all__ = ["bin_gradient", "cumulative_histograms", "cumulative_weights"]


def cumulative_histograms(t: Tensor, num_bins: int, scratch: Tensor, fused: bool = False) -> Tensor:
    """``[c, num_bins + 1]`` cumulative histograms of ``clamp(t, 0, num_bins)``, ``t [c, N]``.

    ``scratch`` is a ``[c, N]`` buffer the torch path may overwrite; ``fused`` takes the Triton pass instead
    (where ``fused_kernels_run``).
    """
    if fused:
        return fused_cumulative_histograms(t, num_bins)
    n_rows, n_cols = t.shape
    H = t.new_empty(n_rows, num_bins + 1)
    for level in range(num_bins):
        # -C_l, exactly where it is not 0 or -1; the clamp saturates positions outside [0, num_bins] as
        # clamping them first would (C_l is 1 for every t <= 0 and 0 for every t >= num_bins, l < num_bins).
        torch.sub(t, level + 1, out=scratch).clamp_(-1, 0)
        H[:, level] = -scratch.sum(1)
    H[:, num_bins] = n_cols  # every t <= num_bins
    return H


def cumulative_weights(t: Tensor, num_bins: int) -> Tensor:
    """``[..., num_bins + 1]``: the weights an item at ``t`` puts on bins ``0..l``, ``clamp(l + 1 - t, 0, 1)``,
    for every ``l``. For the few columns of a row (``[c, P]``); whole blocks go through
    :func:`cumulative_histograms`."""
    levels = torch.arange(1, num_bins + 2, device=t.device, dtype=t.dtype)
    return (levels - t[..., None]).clamp_(0, 1)


def bin_gradient(
    t: Tensor, slopes: Tensor, scratch: Tensor, workspace: Workspace, fused: bool = False
) -> Tensor:
    """``[c, N]``: ``slopes[r, l]`` at every position ``t[r, j]`` whose lower bin is ``l`` (``slopes`` is
    ``[c, num_bins]``, the top position ``num_bins`` reads bin ``num_bins - 1``), 0 outside ``[0, num_bins]``.

    Written into ``scratch`` (which must not be ``t``); ``fused`` takes the Triton pass.
    """
    if fused:
        return fused_bin_gradient(t, slopes, scratch)
    num_bins = slopes.shape[1]
    low = torch.floor(t, out=scratch).clamp_(0, num_bins - 1)
    low_index = workspace.take("low", tuple(t.shape), torch.int64).copy_(low)
    grad = torch.gather(slopes, 1, low_index, out=scratch)
    return grad.masked_fill_((t < 0) | (t > num_bins), 0.0)
