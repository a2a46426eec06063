"""``train.deterministic``: bit-identical runs on GPUs, as CPU runs already are.

What varies from run to run on a GPU, and what fixes it:

- float atomics: ``scatter_add_`` / ``index_add_`` on CUDA (PNP's and Smooth-AP's gradients, the backward of
  gathers and embeddings; FastAP's histograms need none) add in arrival order.
  ``torch.use_deterministic_algorithms(True)`` switches them to sorted, atomic-free kernels, and raises on the
  few operations that have none (so nothing non-deterministic runs silently);
- cuDNN's autotuner picks a convolution algorithm by timing, which may differ between runs, and some of its
  algorithms use atomics: ``cudnn.benchmark = False``, ``cudnn.deterministic = True``;
- cuBLAS splits reductions over a workspace whose layout must be fixed: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``
  (read when cuBLAS starts, so it is set before the first CUDA matmul of the process).

``torch.use_deterministic_algorithms(True)`` also fills every fresh tensor (``torch.empty`` and the like) with NaN
by default, so that a kernel reading memory it never wrote shows as NaN instead of varying silently. That costs a
write of every new buffer (large on a GPU) and turns a harmless read of scratch space into a NaN loss, so it is
off unless asked for (``train.deterministic_fill``): a check to run when a deterministic run still varies.

The data plan, the augmentations and the chunked step's RNG replay are seeded independently of all this.
Collectives (NCCL all-reduce, reduce-scatter) are deterministic for a fixed world size and topology.
"""

from __future__ import annotations

import os

import torch

__all__ = ["CUBLAS_WORKSPACE", "set_deterministic"]

CUBLAS_WORKSPACE = ":4096:8"


def set_deterministic(enabled: bool, fill_uninitialized_memory: bool = False) -> None:
    """Turn deterministic algorithms on (``enabled``) for this process; with False, leave the defaults alone.
    ``fill_uninitialized_memory``: also fill fresh tensors with NaN (torch's default in deterministic mode)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = fill_uninitialized_memory  # type: ignore[attr-defined]
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
