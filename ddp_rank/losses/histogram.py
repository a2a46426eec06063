"""FastAP's passes over a block of bin positions ``t [c, N]``: cumulative soft histograms and the gradient.

Positions are taken as clamped to ``[0, num_bins]`` (rows a hair off unit length must not extrapolate the
kernel), without a clamping pass over the block: the histograms below saturate at both ends by themselves,
and the gradient is 0 where the clamp is active, as for ``torch.clamp``.

Three implementations of each:

- ``torch``: plain tensor ops. The histograms subtract every level from a few rows at once into a
  ``[rows, num_bins, N]`` buffer, clamp it and sum it (three ops per sub-block of rows, whatever the number of
  bins); the gradient reads each position's bin from a per-row table with one ``gather``, keyed by
  ``floor(t) + ceil(t)`` (which tells a position on an edge from one inside a bin without a comparison pass).
  On CPU the rows go in sub-blocks whose buffers stay in cache (``rows.pass_row_blocks``): each of these
  passes is a few arithmetic instructions per element, so from memory they would wait on it. Scatter-adds into
  the two bins each position touches would do less arithmetic but cost about 10 ns an element each on CPU
  (measured on the 2-core test machine), several times the whole ``[rows, num_bins, N]`` pass.
- ``triton``: one fused pass each (``triton_kernels.py``): the histograms keep all the bins' sums of a row in
  registers, so the block is read once whatever the number of bins. Where they cannot run, the torch path does.
- ``native``: the torch path's two passes as C compiled for the CPU (``cpu_kernels.py``, where
  ``workspace.native``): one loop over each row, which skips the bins a tile of it does not reach.

All three form every ``clamp(l + 1 - t, 0, 1)`` before adding it: summing ``clamp(t, l, l + 1)`` and subtracting the
total from ``(l + 1) N`` would cancel away float32's digits at large N.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ddp_rank.losses.cpu_kernels import native_bin_gradient, native_cumulative_histograms
from ddp_rank.losses.rows import Workspace, pass_row_blocks
from ddp_rank.losses.triton_kernels import fused_bin_gradient, fused_cumulative_histograms

__all__ = ["bin_gradient", "cumulative_histograms", "cumulative_weights", "histogram_pass_bytes"]


def histogram_pass_bytes(n_cols: int, num_bins: int, itemsize: int) -> int:
    """Work space of one row in the torch passes: the ``[num_bins, N]`` levels, or the gradient's ceilings and
    its int32 and int64 keys."""
    return n_cols * max(num_bins * itemsize, itemsize + 4 + 8)


def cumulative_histograms(t: Tensor, num_bins: int, workspace: Workspace, fused: bool = False) -> Tensor:
    """``[c, num_bins + 1]`` cumulative histograms of ``clamp(t, 0, num_bins)``, ``t [c, N]``.

    ``fused`` takes the Triton pass instead (where ``fused_kernels_run``), ``workspace.native`` the compiled one.
    """
    if fused:
        return fused_cumulative_histograms(t, num_bins)
    if workspace.native:
        return native_cumulative_histograms(t, num_bins)
    n_rows, n_cols = t.shape
    minus_H = t.new_empty(n_rows, num_bins)
    levels = torch.arange(1, num_bins + 1, device=t.device, dtype=t.dtype)[:, None]  # [num_bins, 1]
    row_bytes = histogram_pass_bytes(n_cols, num_bins, t.element_size())
    for rows in pass_row_blocks(n_rows, row_bytes, workspace):
        t_rows = t[rows]
        levels_rows = workspace.take("levels", (t_rows.shape[0], num_bins, n_cols), t.dtype)
        # -C_l, exactly where it is not 0 or -1; the clamp saturates positions outside [0, num_bins] as
        # clamping them first would (C_l is 1 for every t <= 0 and 0 for every t >= num_bins, l < num_bins).
        torch.sub(t_rows[:, None, :], levels, out=levels_rows).clamp_(-1, 0)
        torch.sum(levels_rows, 2, out=minus_H[rows])
    return torch.cat([minus_H.neg_(), minus_H.new_full((n_rows, 1), n_cols)], 1)  # every t <= num_bins


def cumulative_weights(t: Tensor, num_bins: int) -> Tensor:
    """``[..., num_bins + 1]``: the weights an item at ``t`` puts on bins ``0..l``, ``clamp(l + 1 - t, 0, 1)``,
    for every ``l``. For the few columns of a row (``[c, P]``); whole blocks go through
    :func:`cumulative_histograms`."""
    levels = torch.arange(1, num_bins + 2, device=t.device, dtype=t.dtype)
    return (levels - t[..., None]).clamp_(0, 1)


def bin_gradient(t: Tensor, slopes: Tensor, out: Tensor, workspace: Workspace, fused: bool = False) -> Tensor:
    """``[c, N]``: ``slopes[r, l]`` at every position ``t[r, j]`` whose lower bin is ``l`` (``slopes`` is
    ``[c, num_bins]``, the top position ``num_bins`` reads bin ``num_bins - 1``), 0 outside ``[0, num_bins]``.

    Written into ``out``, which may be ``t`` itself on the torch path (each row is read before it is written);
    ``fused`` takes the Triton pass, whose ``out`` must be another buffer, ``workspace.native`` the compiled one.
    """
    if fused:
        return fused_bin_gradient(t, slopes, out)
    if workspace.native:
        return native_bin_gradient(t, slopes, out)
    n_rows, n_cols = t.shape
    num_bins = slopes.shape[1]
    # The key floor(t) + ceil(t) is 2l at t = l exactly and 2l + 1 inside (l, l + 1), so one table per row over
    # the keys, clamped to [-1, 2 num_bins + 1] and shifted by one, holds every case: 0 below 0, slope l on [l,
    # l + 1), the last slope again at num_bins exactly, 0 above it (rows a hair off unit length). No mask pass
    # and no host check of where positions lie (a GPU's host would wait twice a chunk): on CPU a comparison into
    # a bool mask and a masked fill took as long as all the rest of this pass, ``torch.bucketize``'s binary
    # search 4.5x. The float keys go to int64 through int32: a direct float-to-int64 copy is not vectorised and
    # took twice as long as the two copies.
    zero = slopes.new_zeros(n_rows, 1)
    table = torch.cat([zero, slopes.repeat_interleave(2, 1), slopes[:, -1:], zero], 1).to(t.dtype)
    row_bytes = histogram_pass_bytes(n_cols, 1, t.element_size())
    for rows in pass_row_blocks(n_rows, row_bytes, workspace):
        t_rows, out_rows = t[rows], out[rows]
        shape = tuple(t_rows.shape)
        ceilings = torch.ceil(t_rows, out=workspace.take("ceil", shape, t.dtype))
        keys = torch.floor(t_rows, out=out_rows).add_(ceilings).clamp_(-1, 2 * num_bins + 1).add_(1)
        keys32 = workspace.take("key32", shape, torch.int32).copy_(keys)
        keys64 = workspace.take("key64", shape, torch.int64).copy_(keys32)
        torch.gather(table[rows], 1, keys64, out=out_rows)
    return out
