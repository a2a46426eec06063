"""The row interface shared by every listwise loss: query rows against a database, in memory-bounded chunks.

All the losses here are means over queries of a per-query term, so they shard by query rows. A caller (a single
process, or one rank of a job) hands over some query rows ``Q [q, d]`` that are themselves rows ``query_index``
of the database ``E [N, d]``; the driver below walks the queries in chunks of ``c`` rows, forms the similarity
block ``S_cn = Q_c E^T`` and lets the loss family turn it into per-query losses and ``G_cn = dl/dS_cn``. The
gradients then need only two matmuls per chunk:

    dl/dQ_c = G_cn E          dl/dE += G_cn^T Q_c

so no tensor larger than ``c x N`` (or ``c x P x N`` for rank-based losses, P = positives per query) ever
exists, and the chunk size follows from a memory budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Work space a chunk may use when the caller gives no budget. On CPU small chunks stay in cache and lose
# nothing; on a GPU large chunks amortise the kernel launches of the per-chunk maths.
DEFAULT_BUDGET_BYTES = {"cpu": 32 * 2**20, "cuda": 1 * 2**30}


@dataclass
class RowsOutput:
    """What a loss returns for a set of query rows.

    Gradients are those of ``sum over valid queries of losses`` (not of the mean): the caller knows the
    global number of valid queries and divides once. They are in the compute dtype (float32, or float64
    for float64 inputs) and are ``None`` when no gradient was asked for.
    """

    losses: Tensor  # [q] per-query loss, 0 where the query is not valid
    valid: Tensor  # [q] bool: the query has a positive and counts in the mean
    grad_queries: Tensor | None  # [q, d]
    grad_database: Tensor | None  # [N, d]

    @property
    def n_valid(self) -> int:
        return int(self.valid.sum())

    @property
    def loss_sum(self) -> Tensor:
        return self.losses.sum()


class Workspace:
    """Buffers reused by every chunk of one ``rows`` call.

    The per-chunk tensors are tens of MB; allocating them afresh for each chunk costs more than the maths on
    CPU (the allocator hands big blocks back to the kernel, and every new one is page-faulted in again: a
    38 MB subtraction took 39 ms into a new tensor and 4 ms into a reused one). A buffer is sized by the
    first (largest) chunk and viewed at the size of each later one.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        """An uninitialised ``[*shape]`` tensor; valid until ``take`` is called with the same name."""
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


@dataclass
class ChunkInputs:
    """Everything a loss family needs about one chunk of c query rows besides the similarity block."""

    query_labels: Tensor  # [c] int64
    self_columns: Tensor  # [c] int64: the column of each query in the database
    labels: LabelIndex
    max_class_size: int  # P: the largest class among all the queries of this ``rows`` call
    workspace: Workspace

    def same_class(self) -> tuple[Tensor, Tensor]:
        """``(index [c, P], mask [c, P])``: the columns sharing each query's label, the query included."""
        return self.labels.same_class(self.query_labels, self.self_columns, self.max_class_size)


class LabelIndex:
    """The database grouped by label, so that the positives of any query are a contiguous slice.

    Built once per ``rows`` call in O(N log N). Losses then reach a chunk's same-class columns through a
    padded ``[c, P]`` index (P the largest class involved) instead of comparing labels over ``[c, N]``.
    """

    def __init__(self, database_labels: Tensor) -> None:
        self.order = torch.argsort(database_labels, stable=True)
        self.classes, self.class_sizes = torch.unique_consecutive(
            database_labels[self.order], return_counts=True
        )
        self.class_starts = torch.cumsum(self.class_sizes, 0) - self.class_sizes

    def class_sizes_of(self, labels: Tensor) -> Tensor:
        """[c] number of database items with each label (the query itself included)."""
        return self.class_sizes[torch.searchsorted(self.classes, labels)]

    def max_class_size(self, labels: Tensor) -> int:
        return int(self.class_sizes_of(labels).max()) if labels.numel() else 0

    def same_class(self, query_labels: Tensor, self_columns: Tensor, width: int) -> tuple[Tensor, Tensor]:
        """Columns sharing each query's label, padded to ``width``: ``(index [c, P], mask [c, P])``.

        ``width`` must be at least the largest class of these queries (known once per call, so no device
        sync per chunk). Padding entries repeat the query's own column (always a same-class column), so that
        writing a value to every indexed column never touches another class; weights must still be
        multiplied by the mask.
        """
        group = torch.searchsorted(self.classes, query_labels)
        sizes = self.class_sizes[group]
        offsets = torch.arange(width, device=query_labels.device)
        mask = offsets[None, :] < sizes[:, None]
        slots = (self.class_starts[group][:, None] + offsets[None, :]).clamp_(max=self.order.numel() - 1)
        index = torch.where(mask, self.order[slots], self_columns[:, None])
        return index, mask


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; everything else is computed in float32 (fp16 sigmoid ranks overflow)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_rows(bytes_per_row: int, budget: int | None, device: torch.device, override: int | None) -> int:
    """Query rows per chunk: ``override`` when given, else as many as fit the budget (at least one)."""
    if override is not None:
        return max(1, int(override))
    if budget is None:
        budget = DEFAULT_BUDGET_BYTES["cuda" if device.type == "cuda" else "cpu"]
    return max(1, budget // max(1, bytes_per_row))
