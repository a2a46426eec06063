"""Listwise ranking losses, exact and memory-linear in the batch size.

Every loss is an ``nn.Module`` called as ``loss(embeddings [N, d], labels [N]) -> 0-d tensor`` and also offers
``rows(...)``, the query-row interface the distributed layer computes the global batch with.
"""

from ddp_rank.losses.base import ListwiseLoss, ListwiseOptions
from ddp_rank.losses.fastap import FastAPLoss
from ddp_rank.losses.pnp import PNPLoss
from ddp_rank.losses.rows import RowsOutput
from ddp_rank.losses.smooth_ap import SmoothAPLoss

__all__ = ["FastAPLoss", "ListwiseLoss", "ListwiseOptions", "PNPLoss", "RowsOutput", "SmoothAPLoss"]
