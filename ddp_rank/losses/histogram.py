"""FastAP's cumulative soft histograms of a block of bin positions: ``H[r, l] = sum_j clamp(l + 1 - t[r, j], 0, 1)``.

Two implementations of one function:

- ``torch``: one subtraction, one clamp and one row sum per bin, through a ``[c, N]`` scratch buffer. Runs
  anywhere; reads and writes the block about five times per bin.
- ``triton``: one fused pass on CUDA. Each program owns a row, walks it in tiles and keeps all the bins' sums in
  registers, so the block is read once whatever the number of bins. It runs on CUDA tensors, and on CPU tensors
  only under Triton's interpreter (``TRITON_INTERPRET=1``, set before Triton is imported), which is how the tests
  check it against the torch path. Everywhere else the torch path runs.

Both form every ``clamp(l + 1 - t, 0, 1)`` before adding it: summing ``clamp(t, l, l + 1)`` and subtracting the
total from ``(l + 1) N`` would cancel away float32's digits at large N.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["HISTOGRAM_KERNELS", "cumulative_histograms", "cumulative_weights", "triton_runs_on"]

HISTOGRAM_KERNELS = ("torch", "triton")


def cumulative_histograms(t: Tensor, num_bins: int, scratch: Tensor, kernel: str = "torch") -> Tensor:
    """``[c, num_bins + 1]`` cumulative histograms of ``t [c, N]`` (values in [0, num_bins]).

    ``scratch`` is a ``[c, N]`` buffer the torch path may overwrite. ``kernel="triton"`` takes the fused pass
    where it can run (float32 on CUDA, or the interpreter) and the torch path elsewhere.
    """
    if kernel == "triton" and triton_runs_on(t):
        return _triton_histograms(t, num_bins)
    n_rows, n_cols = t.shape
    H = t.new_empty(n_rows, num_bins + 1)
    for level in range(num_bins):
        torch.sub(t, level + 1, out=scratch).clamp_(-1, 0)  # -C_l, exactly where it is not 0 or -1
        H[:, level] = -scratch.sum(1)
    H[:, num_bins] = n_cols  # every t <= num_bins
    return H


def cumulative_weights(t: Tensor, num_bins: int) -> Tensor:
    """``[..., num_bins + 1]``: the weights an item at ``t`` puts on bins ``0..l``, ``clamp(l + 1 - t, 0, 1)``,
    for every ``l``. For the few columns of a row (``[c, P]``); whole blocks go through
    :func:`cumulative_histograms`."""
    levels = torch.arange(1, num_bins + 2, device=t.device, dtype=t.dtype)
    return (levels - t[..., None]).clamp_(0, 1)


def triton_runs_on(t: Tensor) -> bool:
    """Whether the fused kernel can take ``t``: float32, on CUDA (or on CPU under the interpreter), Triton
    importable."""
    if t.dtype != torch.float32 or t.stride(1) != 1:
        return False
    if not (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return _kernel() is not None


def _triton_histograms(t: Tensor, num_bins: int) -> Tensor:
    kernel = _kernel()
    assert kernel is not None
    n_rows, n_cols = t.shape
    out = torch.empty(n_rows, num_bins + 1, dtype=torch.float32, device=t.device)
    levels = 1 << num_bins.bit_length()  # a power of two > num_bins, as tl.arange needs
    kernel[(n_rows,)](t, out, n_cols, t.stride(0), NUM_BINS=num_bins, LEVELS=levels, BLOCK=256)
    return out


@functools.cache
def _kernel() -> Any:
    """The compiled-on-first-use Triton kernel, or None where Triton is not installed."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def cumulative_histogram_rows(
        t_ptr: Any,
        out_ptr: Any,
        n_cols: Any,
        row_stride: Any,
        NUM_BINS: tl.constexpr,
        LEVELS: tl.constexpr,
        BLOCK: tl.constexpr,
    ) -> None:
        row = tl.program_id(0).to(tl.int64)  # row * row_stride passes 2**31 in blocks over 8 GiB
        levels = tl.arange(0, LEVELS).to(tl.float32)
        sums = tl.zeros([LEVELS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            # Past the row's end: a position beyond every bin, which adds 0 to all of them.
            t = tl.load(t_ptr + row * row_stride + cols, mask=cols < n_cols, other=NUM_BINS + 1.0)
            weights = tl.minimum(tl.maximum(levels[:, None] + 1.0 - t[None, :], 0.0), 1.0)  # [LEVELS, BLOCK]
            sums += tl.sum(weights, axis=1)
        bins = tl.arange(0, LEVELS)
        tl.store(out_ptr + row * (NUM_BINS + 1) + bins, sums, mask=bins <= NUM_BINS)

    return cumulative_histogram_rows
