"""Fused Triton kernels for the losses' per-block passes, and where they may run.

Every kernel here computes the same function as a plain torch path beside its caller (``histogram.py``,
``sigmoid_ranks.py``); a loss takes them with ``kernel="triton"`` where :func:`fused_kernels_run` says they
can: float32 CUDA tensors, or CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported), which is how the tests check them against the torch paths. The default ``kernel="auto"``
takes them on CUDA only (``ListwiseLoss.takes_fused_kernels``). The tests also compile each
one for real GPUs (V100 to B200: sm_70 to sm_100) without one: the interpreter runs Python that the
compiler may refuse.

A program owns one row of a ``[c, N]`` block (the rank sums: a row and a tile of its same-class columns; the
rank gradient: a tile of a row's columns) and keeps its sums in registers, so each pass reads a block once
where the torch path reads and writes it several times, or builds ``[c, P, N]`` from it. Row offsets are
64-bit: a block passes 2**31 elements at 8 GiB.
"""

from __future__ import annotations

import contextlib
import functools
import os
from types import SimpleNamespace

import torch
from torch import Tensor

__all__ = [
    "fused_bin_gradient",
    "fused_cumulative_histograms",
    "fused_kernels_run",
    "fused_sigmoid_rank_gradient",
    "fused_sigmoid_rank_sums",
    "jit_kernels",
]

# Elements of one [rows, BLOCK] tile held in registers (4 warps: 32 per thread).
_TILE_ELEMENTS = 4096


def fused_kernels_run(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernels run for blocks of ``dtype`` on ``device``: float32, on CUDA (or on CPU under
    the interpreter), and Triton importable. The loss driver asks once per call, so that the chunk plan and
    every chunk agree on the path."""
    if dtype != torch.float32:
        return False
    if not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    return jit_kernels() is not None


def _check_rows(*tensors: Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.dim() != 2 or t.stride(1) != 1:
            raise ValueError(
                f"the fused kernels take float32 [rows, columns] tensors with contiguous rows, got {t.dtype} "
                f"of shape {tuple(t.shape)} and strides {t.stride()}"
            )


def fused_cumulative_histograms(t: Tensor, num_bins: int) -> Tensor:
    """``H[r, l] = sum_j clamp(l + 1 - t'[r, j], 0, 1)`` for ``l = 0..num_bins``, ``t' = clamp(t, 0, num_bins)``:
    ``[c, num_bins + 1]``."""
    kernels = _required()
    _check_rows(t)
    n_rows, n_cols = t.shape
    out = torch.empty(n_rows, num_bins + 1, dtype=torch.float32, device=t.device)
    levels = 1 << num_bins.bit_length()  # a power of two > num_bins, as tl.arange needs
    block = max(16, _TILE_ELEMENTS // levels)  # a [LEVELS, BLOCK] tile of about the same size for any bins
    if n_rows:
        with _on_device(t):
            kernels.cumulative_histogram_rows[(n_rows,)](
                t, out, n_cols, t.stride(0), NUM_BINS=num_bins, LEVELS=levels, BLOCK=block
            )
    return out


def fused_bin_gradient(t: Tensor, slopes: Tensor, out: Tensor) -> Tensor:
    """``out[r, j] = slopes[r, min(floor(t[r, j]), num_bins - 1)]`` where ``0 <= t[r, j] <= num_bins``, else 0;
    ``slopes`` is ``[c, num_bins]``. Returns ``out`` (``[c, N]``, laid out like ``t``)."""
    kernels = _required()
    _check_rows(t, out)
    n_rows, n_cols = t.shape
    if out.stride() != t.stride():
        raise ValueError("the gradient buffer must be laid out like the bin positions")
    if n_rows:
        with _on_device(t):
            kernels.bin_gradient_rows[(n_rows,)](
                t,
                slopes.to(torch.float32).contiguous(),
                out,
                n_cols,
                t.stride(0),
                NUM_BINS=slopes.shape[1],
                BLOCK=1024,
            )
    return out


def fused_sigmoid_rank_sums(scores: Tensor, same_scores: Tensor) -> tuple[Tensor, Tensor]:
    """``R[a, i] = sum_j sigma_aij`` and ``D[a, i] = sum_j sigma'_aij`` (``sigma' = sigma (1 - sigma)``, which
    the gradient needs) for ``sigma_aij = sigmoid(scores[a, j] - same_scores[a, i])``: two ``[c, P]``, with no
    ``[c, P, N]``."""
    kernels = _required()
    _check_rows(scores)
    n_rows, n_cols = scores.shape
    n_same = same_scores.shape[1]
    same_scores = same_scores.to(torch.float32).contiguous()
    ranks = torch.zeros(n_rows, n_same, dtype=torch.float32, device=scores.device)
    slope_sums = torch.zeros_like(ranks)
    p_tile, block = _rank_tiles(n_same)
    if n_rows and n_same:
        with _on_device(scores):
            kernels.sigmoid_rank_sums[(n_rows, -(-n_same // p_tile))](
                scores,
                same_scores,
                ranks,
                slope_sums,
                n_cols,
                n_same,
                scores.stride(0),
                P_TILE=p_tile,
                BLOCK=block,
            )
    return ranks, slope_sums


def fused_sigmoid_rank_gradient(
    scores: Tensor, same_scores: Tensor, dloss_dranks: Tensor, out: Tensor
) -> Tensor:
    """``out[a, j] = sum_i w[a, i] sigma'_aij`` for ``w = d(loss)/dR [c, P]`` (written, not added).

    ``out`` is a ``[c, N]`` buffer other than ``scores``, laid out like it. Each program owns a tile of
    columns of one row and walks all the same-class tiles for it, so every output element is written once.
    """
    kernels = _required()
    _check_rows(scores, out)
    n_rows, n_cols = scores.shape
    n_same = same_scores.shape[1]
    if out.data_ptr() == scores.data_ptr() or out.stride() != scores.stride():
        raise ValueError("the gradient needs its own [c, N] buffer, laid out like the scores")
    if n_same == 0:
        return out.zero_()
    p_tile, block = _rank_tiles(n_same)
    if n_rows and n_cols:
        with _on_device(scores):
            kernels.sigmoid_rank_gradient[(n_rows, -(-n_cols // block))](
                scores,
                same_scores.to(torch.float32).contiguous(),
                dloss_dranks.to(torch.float32).contiguous(),
                out,
                n_cols,
                n_same,
                scores.stride(0),
                P_TILE=p_tile,
                BLOCK=block,
            )
    return out


def _rank_tiles(n_same: int) -> tuple[int, int]:
    """``(P_TILE, BLOCK)``: up to 32 same-class columns per tile, and as many block columns as fill it."""
    p_tile = min(32, 1 << max(0, n_same - 1).bit_length())
    return p_tile, max(128, _TILE_ELEMENTS // p_tile)


def _on_device(t: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it the tensor's (a rank may hold tensors on another)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _required() -> SimpleNamespace:
    kernels = jit_kernels()
    if kernels is None:
        raise RuntimeError("kernel='triton' needs Triton (pip install triton); use kernel='torch'")
    return kernels


@functools.cache
def jit_kernels() -> SimpleNamespace | None:
    """The ``@triton.jit`` kernels (compiled on first launch), or None where Triton is not installed.

    Their arguments carry no annotations but ``tl.constexpr``: Triton's compiler resolves annotations as
    globals of the kernel, and a name such as ``typing.Any`` fails to compile (the interpreter accepts it).
    """
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def cumulative_histogram_rows(
        t_ptr,
        out_ptr,
        n_cols,
        row_stride,
        NUM_BINS: tl.constexpr,
        LEVELS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        levels = tl.arange(0, LEVELS).to(tl.float32)
        sums = tl.zeros([LEVELS], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            cols_ok = cols < n_cols
            t = tl.load(t_ptr + row * row_stride + cols, mask=cols_ok, other=0.0)
            t = tl.minimum(tl.maximum(t, 0.0), NUM_BINS)
            # Past the row's end: a position beyond every bin, which adds 0 to all of them.
            t = tl.where(cols_ok, t, NUM_BINS + 1.0)
            weights = tl.minimum(tl.maximum(levels[:, None] + 1.0 - t[None, :], 0.0), 1.0)  # [LEVELS, BLOCK]
            sums += tl.sum(weights, axis=1)
        bins = tl.arange(0, LEVELS)
        tl.store(out_ptr + row * (NUM_BINS + 1) + bins, sums, mask=bins <= NUM_BINS)

    @triton.jit
    def bin_gradient_rows(
        t_ptr,
        slopes_ptr,
        out_ptr,
        n_cols,
        row_stride,
        NUM_BINS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Each element reads its row's slope at its lower bin: a gather from a table of NUM_BINS floats,
        # which stays in L1.
        row = tl.program_id(0).to(tl.int64)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            cols_ok = cols < n_cols
            t = tl.load(t_ptr + row * row_stride + cols, mask=cols_ok, other=0.0)
            inside = (t >= 0.0) & (t <= NUM_BINS)
            low = tl.minimum(tl.floor(tl.maximum(t, 0.0)), NUM_BINS - 1.0).to(tl.int32)
            slope = tl.load(slopes_ptr + row * NUM_BINS + low, mask=cols_ok & inside, other=0.0)
            tl.store(out_ptr + row * row_stride + cols, slope, mask=cols_ok)

    @triton.jit
    def sigmoid_rank_sums(
        scores_ptr,
        same_ptr,
        ranks_ptr,
        slope_sums_ptr,
        n_cols,
        n_same,
        row_stride,
        P_TILE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row, tile of same-class columns). Padding columns and rows are masked on load (-inf
        # scores: a sigmoid and a slope of exactly 0) and on store.
        row = tl.program_id(0).to(tl.int64)
        same = tl.program_id(1) * P_TILE + tl.arange(0, P_TILE)
        same_ok = same < n_same
        s_same = tl.load(same_ptr + row * n_same + same, mask=same_ok, other=0.0)
        ranks = tl.zeros([P_TILE], dtype=tl.float32)
        slope_sums = tl.zeros([P_TILE], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(scores_ptr + row * row_stride + cols, mask=cols < n_cols, other=float("-inf"))
            sigma = tl.sigmoid(s[None, :] - s_same[:, None])
            ranks += tl.sum(sigma, axis=1)
            slope_sums += tl.sum(sigma - sigma * sigma, axis=1)
        tl.store(ranks_ptr + row * n_same + same, ranks, mask=same_ok)
        tl.store(slope_sums_ptr + row * n_same + same, slope_sums, mask=same_ok)

    @triton.jit
    def sigmoid_rank_gradient(
        scores_ptr,
        same_ptr,
        weight_ptr,
        grad_ptr,
        n_cols,
        n_same,
        row_stride,
        P_TILE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # Program (row, tile of columns): the tile's gradient summed over every same-class tile in
        # registers, then stored once.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cols_ok = cols < n_cols
        s = tl.load(scores_ptr + row * row_stride + cols, mask=cols_ok, other=float("-inf"))
        grad = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, n_same, P_TILE):
            same = first + tl.arange(0, P_TILE)
            same_ok = same < n_same
            s_same = tl.load(same_ptr + row * n_same + same, mask=same_ok, other=0.0)
            weight = tl.load(weight_ptr + row * n_same + same, mask=same_ok, other=0.0)
            sigma = tl.sigmoid(s[None, :] - s_same[:, None])
            grad += tl.sum((sigma - sigma * sigma) * weight[:, None], axis=0)
        tl.store(grad_ptr + row * row_stride + cols, grad, mask=cols_ok)

    return SimpleNamespace(
        cumulative_histogram_rows=cumulative_histogram_rows,
        bin_gradient_rows=bin_gradient_rows,
        sigmoid_rank_sums=sigmoid_rank_sums,
        sigmoid_rank_gradient=sigmoid_rank_gradient,
    )
