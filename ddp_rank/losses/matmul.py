"""The loss's similarity matmuls: the operands of ``shift + scale * Q E^T`` and the precision they run in.

``ListwiseLoss.rows`` computes every ``[c, N]`` block with one plain matmul of these operands, in the
precision ``loss.matmul_precision`` names: float32 (``highest``), TF32 on CUDA (``tf32``) or bf16 operands with
float32 accumulation (``bf16``). Apart from the driver (``base``) because what a torch version offers for it
(``fp32_precision``, ``mm``'s ``out_dtype``) is asked and worked around here, in one place.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator

import torch
from torch import Tensor

MATMUL_PRECISIONS = ("highest", "tf32", "bf16")


@contextlib.contextmanager
def matmuls_in(precision: str) -> Iterator[None]:
    """TF32 for the loss's matmuls when asked (CUDA only; CPU float32 matmuls are unaffected), the caller's
    setting put back after. Through ``fp32_precision`` where torch has it: once a program has set that one,
    reading the legacy ``allow_tf32`` raises (torch refuses a mix of the two), while saving and restoring
    ``fp32_precision`` keeps either kind of setting as the caller left it."""
    if precision != "tf32":
        yield
        return
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")
    previous = matmul.fp32_precision if new_api else matmul.allow_tf32
    if new_api:
        matmul.fp32_precision = "tf32"
    else:
        matmul.allow_tf32 = True
    try:
        yield
    finally:
        if new_api:
            matmul.fp32_precision = previous
        else:
            matmul.allow_tf32 = previous


def bf16_mm(a: Tensor, b: Tensor) -> Tensor:
    """bf16 operands, float32 accumulation and result on CUDA (``out_dtype``); on CPU, which has no such kernel
    and no bf16 speed-up either, the product is rounded to bf16 before it is widened."""
    if a.is_cuda:
        return mm_float32_out(a, b)
    return torch.mm(a, b).float()


def mm_float32_out(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` accumulated and returned in float32. A torch whose ``mm`` has no ``out_dtype`` (older than the
    project's tested versions) gets float32 operands instead: the same accuracy, without bf16's speed."""
    if mm_takes_out_dtype():
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


@functools.cache
def mm_takes_out_dtype() -> bool:
    """Whether ``torch.mm`` knows the ``out_dtype`` keyword (asked once, on two 1 x 1 tensors)."""
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    try:
        torch.mm(one, one, out_dtype=torch.float32)
    except TypeError:
        warnings.warn(
            f"torch {torch.__version__} has no torch.mm(out_dtype=...): loss.matmul_precision=bf16 multiplies in "
            "float32 (same accuracy, no bf16 speed-up); a newer torch has the bf16 kernel",
            stacklevel=2,
        )
        return False
    except RuntimeError:
        pass  # the keyword is known; this device or dtype has no kernel for it, which CUDA bf16 does
    return True


def affine_operands(queries: Tensor, database: Tensor, scale: float, shift: float) -> tuple[Tensor, Tensor]:
    """Operands whose product is ``shift + scale * Q E^T``: the scale goes into the queries and the shift
    into an extra column of ones, so each block comes out of one plain matmul with no pass of its own."""
    scaled = queries * scale
    if shift == 0.0:
        return scaled, database
    scaled = torch.cat([scaled, scaled.new_full((scaled.shape[0], 1), shift)], dim=1)
    return scaled, torch.cat([database, database.new_ones(database.shape[0], 1)], dim=1)
